"""Writes tests/openapi/openai.json: OpenAI's published OpenAPI document cut down to the routes ortfleet
serves and the component schemas they reach.

    python tests/openapi/trim.py FULL_OPENAPI.json COMMIT

FULL_OPENAPI.json is `openapi.json` of github.com/openai/openai-openapi at COMMIT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROUTES = (
    "/chat/completions",
    "/completions",
    "/models",
    "/models/{model}",
    "/files",
    "/files/{file_id}",
    "/files/{file_id}/content",
    "/batches",
    "/batches/{batch_id}",
    "/batches/{batch_id}/cancel",
    "/responses",
    "/responses/{response_id}",
    "/responses/{response_id}/cancel",
    "/responses/{response_id}/input_items",
)
# Schemas no route names but the suite validates against: stream chunks, stream events, error envelopes.
EXTRA = ("ErrorResponse", "CreateChatCompletionStreamResponse", "ResponseStreamEvent")
PREFIX = "#/components/schemas/"


def _refs(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["$ref"].removeprefix(PREFIX)} if isinstance(node.get("$ref"), str) else set()
        for value in node.values():
            found |= _refs(value)
        return found
    if isinstance(node, list):
        return set().union(*(_refs(value) for value in node)) if node else set()
    return set()


def trim(full: dict[str, Any], commit: str) -> dict[str, Any]:
    schemas = full["components"]["schemas"]
    paths = {route: full["paths"][route] for route in ROUTES}
    todo = _refs(paths) | set(EXTRA)
    kept: dict[str, Any] = {}
    while todo:
        name = todo.pop()
        if name in kept or name not in schemas:
            continue
        kept[name] = schemas[name]
        todo |= _refs(schemas[name])
    info = dict(
        full["info"], **{"x-source": f"https://github.com/openai/openai-openapi/blob/{commit}/openapi.json"}
    )
    return {
        "openapi": full["openapi"],
        "info": info,
        "paths": paths,
        "components": {"schemas": dict(sorted(kept.items()))},
    }


def main() -> None:
    full = json.loads(Path(sys.argv[1]).read_text())
    out = Path(__file__).with_name("openai.json")
    out.write_text(json.dumps(trim(full, sys.argv[2]), indent=1, sort_keys=False) + "\n")


if __name__ == "__main__":
    main()
