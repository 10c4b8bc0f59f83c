"""Structured output: the `response_format` a job may carry, and the grammar the engine is given for it.

The engine (ORT-GenAI's llguidance) constrains each generated token to a JSON schema, a regular
expression or a Lark grammar. Everything a request may ask for is turned into one of those three here.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GuidanceKind = Literal["json_schema", "regex", "lark_grammar"]

# llguidance lets JSON have any whitespace between tokens by default, which a weak model fills with
# whitespace until max_tokens; compact JSON ends sooner and parses the same.
_COMPACT_JSON = {"whitespace_flexible": False}


class Guidance(BaseModel):
    """The grammar one job's output must follow, as the engine takes it."""

    model_config = ConfigDict(extra="forbid")

    kind: GuidanceKind
    grammar: str = Field(..., min_length=1)


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema", description="The JSON schema to follow.")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")


class ResponseFormat(BaseModel):
    """What the output must look like: OpenAI's `text`, `json_object` and `json_schema`, and ortfleet's
    `regex`, `choice` and `grammar` (Lark syntax), which vLLM's guided_* parameters map to."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema", "regex", "choice", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = Field(None, min_length=1, max_length=4096)
    choice: list[str] | None = Field(None, min_length=1, max_length=256)
    grammar: str | None = Field(None, min_length=1, max_length=65_536)

    @model_validator(mode="after")
    def _has_its_value(self) -> ResponseFormat:
        needed = {"json_schema": self.json_schema, "regex": self.regex, "choice": self.choice}
        needed["grammar"] = self.grammar
        if self.type in needed and needed[self.type] is None:
            raise ValueError(f"type {self.type!r} needs the field {self.type!r}")
        if self.choice is not None and not all(self.choice):
            raise ValueError("choice: every choice must be a non-empty string")
        return self

    def guidance(self) -> Guidance | None:
        """The engine's grammar for this format; None for free text."""
        if self.type == "json_object":
            return json_guidance({"type": "object"})
        if self.type == "json_schema":
            assert self.json_schema is not None
            return json_guidance(self.json_schema.schema_)
        if self.type == "regex":
            assert self.regex is not None
            return Guidance(kind="regex", grammar=self.regex)
        if self.type == "choice":
            assert self.choice is not None
            return Guidance(kind="regex", grammar="(" + "|".join(re.escape(c) for c in self.choice) + ")")
        if self.type == "grammar":
            assert self.grammar is not None
            return Guidance(kind="lark_grammar", grammar=self.grammar)
        return None


def json_guidance(schema: dict[str, Any] | bool) -> Guidance:
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if "x-guidance" not in schema:
        schema = {**schema, "x-guidance": _COMPACT_JSON}
    return Guidance(kind="json_schema", grammar=json.dumps(schema, separators=(",", ":")))
