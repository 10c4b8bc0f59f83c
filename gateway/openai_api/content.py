"""OpenAI's content parts (chat messages' and Responses' input items'): read as text, the only kind
ortfleet's models take."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from common.error_codes import ErrorCode
from gateway.errors import ApiError

_NAMES = {  # the parts a client may send that are not text, by what they carry
    "image_url": "images",
    "input_image": "images",
    "file": "files",
    "input_file": "files",
    "input_audio": "audio",
}


def parts_text(parts: list[Any], where: str, kinds: Collection[str]) -> str:
    """The text of `parts` (the field at `where`), one line each; 400 `unsupported_value` naming the first
    part that is not text (its `type` not one of `kinds`)."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(text, str):
            what = _NAMES.get(str(kind), repr(kind))
            raise ApiError(
                400,
                f"{where}.{j}: {what} are not supported by ortfleet (text parts only)",
                param=f"{where}.{j}",
                code=ErrorCode.unsupported_value,
            )
        texts.append(text)
    return "\n".join(texts)
