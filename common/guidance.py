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

# A number the model writes must be one a JSON parser holds exactly, or a weak model writes digits until
# max_tokens. An integer is within ±(2**53 - 1), which every JSON parser holds exactly, JavaScript's
# included (llguidance reads bounds as float64, so int64's own ends cannot be the bound). A number has
# at most 15 significant digits, which a float64 holds exactly (DBL_DIG), and no exponent: up to 15
# digits before the point, or up to 12, 9 or 6 with 3, 6 or 9 after it (each band a range and a
# multipleOf, which llguidance turns into a regular expression).
INTEGER_RANGE = (-(2**53 - 1), 2**53 - 1)
NUMBER_BANDS = ((1e15, 1), (1e12, 1e-3), (1e9, 1e-6), (1e6, 1e-9))
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # values, not schemas


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

    def prompt_text(self) -> str | None:
        """What OpenAI's routes tell the model about a JSON schema (a system message), None for other
        formats. `json_object` adds nothing: OpenAI asks the request itself to say JSON."""
        if self.type == "json_schema":
            assert self.json_schema is not None
            schema = json.dumps(self.json_schema.schema_, separators=(",", ":"), ensure_ascii=False)
            name = self.json_schema.name
            about = f" ({self.json_schema.description})" if self.json_schema.description else ""
            return f"Respond only with JSON that follows the JSON schema {name!r}{about}:\n{schema}"
        return None

    def guidance(self) -> Guidance | None:
        """The engine's grammar for this format; None for free text."""
        if self.type == "json_object":
            return json_guidance(ANY_JSON_OBJECT)
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
    bounded: dict[str, Any] = bounded_numbers(schema)
    if "x-guidance" not in bounded:
        bounded = {**bounded, "x-guidance": _COMPACT_JSON}
    return Guidance(kind="json_schema", grammar=json.dumps(bounded, separators=(",", ":")))


def bounded_numbers(schema: Any) -> Any:
    """The schema with every `integer` bounded to INTEGER_RANGE where it sets no bound, and every
    `number` without a `multipleOf` split into NUMBER_BANDS (within its own bounds)."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    node = {k: v if k in _DATA_KEYWORDS else bounded_numbers(v) for k, v in schema.items()}
    if node.get("type") == "integer":
        low, high = INTEGER_RANGE
        if "minimum" not in node and "exclusiveMinimum" not in node:
            node["minimum"] = low
        if "maximum" not in node and "exclusiveMaximum" not in node:
            node["maximum"] = high
    elif node.get("type") == "number" and "multipleOf" not in node:
        bands = [band for bound, step in NUMBER_BANDS if (band := _band(node, bound, step)) is not None]
        if bands:
            number_keys = {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
            node = {k: v for k, v in node.items() if k not in number_keys} | {"anyOf": bands}
    return node


def _band(node: dict[str, Any], bound: float, step: float) -> dict[str, Any] | None:
    """The number schema of one band, within the node's own bounds; None where they leave it empty."""
    band: dict[str, Any] = {"type": "number", "multipleOf": step}
    low = node.get("minimum", node.get("exclusiveMinimum"))
    high = node.get("maximum", node.get("exclusiveMaximum"))
    if (isinstance(low, int | float) and low > bound) or (isinstance(high, int | float) and high < -bound):
        return None
    for key, own, edge, tighter in (
        ("minimum", low, -bound, max),
        ("maximum", high, bound, min),
    ):
        exclusive = "exclusiveM" + key[1:]
        if isinstance(own, int | float) and tighter(own, edge) == own and own != edge:
            band[exclusive if exclusive in node else key] = own
        else:
            band[key] = edge
    return band


# json_object: any JSON object, with every number in it bounded as above.
ANY_JSON_OBJECT: dict[str, Any] = {
    "$defs": {
        "value": {
            "anyOf": [
                {"type": "string"},
                {"type": "number"},
                {"type": "boolean"},
                {"type": "null"},
                {"type": "array", "items": {"$ref": "#/$defs/value"}},
                {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}},
            ]
        }
    },
    "type": "object",
    "additionalProperties": {"$ref": "#/$defs/value"},
}
