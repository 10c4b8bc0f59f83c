"""The `metadata` of OpenAI's objects (responses, batches): string pairs within OpenAI's bounds."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator

MAX_PAIRS = 16
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 512


def _within_bounds(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > MAX_PAIRS:
        raise ValueError(f"at most {MAX_PAIRS} key-value pairs, not {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_KEY_CHARS:
            raise ValueError(f"a key of {len(key)} characters; keys have at most {MAX_KEY_CHARS}")
        if len(value) > MAX_VALUE_CHARS:
            raise ValueError(
                f"the value of {key!r} has {len(value)} characters; values have at most {MAX_VALUE_CHARS}"
            )
    return metadata


Metadata = Annotated[dict[str, str], AfterValidator(_within_bounds)]
