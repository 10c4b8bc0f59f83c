"""Constrained JSON a weak model cannot derail: numbers a parser holds exactly (common/guidance.py), no key
twice in one object (worker/engines/batcher/json_keys.py and the sampler), the schema shown to the model
(ResponseFormat.prompt_text). Checked against llguidance itself, on a tokenizer of one token per byte."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from llguidance import LLMatcher, LLTokenizer

from common.guidance import ANY_JSON_OBJECT, ResponseFormat, bounded_numbers, json_guidance
from worker.engine import GenerationRequest
from worker.engines.batcher.grammar_starts import Vocabulary, grammar_start
from worker.engines.batcher.json_keys import JsonKeys
from worker.engines.batcher.sampler import RowSampler

pytestmark = pytest.mark.unit

EOS = 256
BYTES = LLTokenizer.from_tiktoken(
    encoder={bytes([i]): i for i in range(256)}, special_tokens={"<eos>": EOS}, pattern=r".", eos_token=EOS
)


def accepts(schema: dict[str, Any] | bool, text: str) -> bool:
    """Whether the engine's grammar for this schema lets the model write exactly `text`."""
    matcher = LLMatcher(BYTES, LLMatcher.grammar_from_json_schema(json_guidance(schema).grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(t) for t in BYTES.tokenize_str(text)) and matcher.is_accepting()


def one(kind: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    value = {"type": kind, **(extra or {})}
    return {"type": "object", "properties": {"x": value}, "required": ["x"], "additionalProperties": False}


@pytest.mark.parametrize(
    ("text", "held"),
    [
        ("999999999999999", True),  # 15 digits
        ("1000000000000000", True),  # the band's own edge
        ("1111111111111111", False),  # 16 digits: past what a float64 holds exactly
        ("-123456789012.345", True),
        ("123456789012.3456", False),  # 16 significant digits
        ("999999.999999999", True),
        ("0.000000001", True),
        ("0.0000000001", False),  # past 9 decimals
        ("1e5", False),  # no exponent
        ("2.5", True),
    ],
)
def test_a_number_has_at_most_15_significant_digits_and_no_exponent(text: str, held: bool) -> None:
    assert accepts(one("number"), '{"x":' + text + "}") is held


def test_an_integer_is_one_every_parser_holds_and_the_schemas_own_bounds_stay() -> None:
    assert accepts(one("integer"), '{"x":-9007199254740991}')  # -(2**53 - 1)
    assert not accepts(one("integer"), '{"x":9007199254740992}')
    assert accepts(one("integer", {"minimum": 0, "maximum": 5}), '{"x":5}')
    assert not accepts(one("integer", {"minimum": 0, "maximum": 5}), '{"x":6}')
    # a number's own bounds stay, within each band; an exclusive bound stays exclusive
    assert not accepts(one("number", {"minimum": 0}), '{"x":-1.5}')
    assert accepts(one("number", {"exclusiveMaximum": 10}), '{"x":9.999}')
    assert not accepts(one("number", {"exclusiveMaximum": 10}), '{"x":10}')
    # a schema's own multipleOf is its own bound, left as it is
    assert bounded_numbers({"type": "number", "multipleOf": 0.5}) == {"type": "number", "multipleOf": 0.5}


def test_numbers_are_bounded_wherever_they_are_and_values_are_left_alone() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"anyOf": [{"type": "number"}, {"type": "null"}]}}},
        "$defs": {"n": {"type": "integer"}},
        "enum": [{"type": "number"}],  # a value that looks like a schema is data
    }
    bounded = bounded_numbers(schema)
    assert "anyOf" in bounded["properties"]["a"]["items"]["anyOf"][0]
    assert bounded["$defs"]["n"]["maximum"] == 2**53 - 1
    assert bounded["enum"] == [{"type": "number"}]
    # json_object: any object, with its numbers bounded at every depth
    assert accepts(ANY_JSON_OBJECT, '{"a":[1,{"b":2.5,"c":null}],"d":"e"}')
    assert not accepts(ANY_JSON_OBJECT, '{"a":[{"b":11111111111111111111}]}')


def test_the_schema_asked_for_is_told_to_the_model() -> None:
    fmt = ResponseFormat.model_validate(
        {"type": "json_schema", "json_schema": {"name": "City", "schema": one("number"), "strict": True}}
    )
    text = fmt.prompt_text()
    assert text is not None and "'City'" in text
    assert json.loads(text.split("\n", 1)[1]) == one("number")  # the schema as sent, not as bounded
    assert ResponseFormat(type="json_object").prompt_text() is None  # the request says JSON itself
    assert ResponseFormat(type="regex", regex="a+").prompt_text() is None


def test_json_keys_tell_a_repeated_key_in_the_same_object_only() -> None:
    keys = JsonKeys()
    keys.feed(b'{"a":1,"b":{"a":')  # "a" again, but in another object
    assert not keys.would_repeat(b'"x"')  # a value string is not a key
    keys.feed(b'"x"},')
    assert keys.would_repeat(b'"a"')
    assert keys.would_repeat(b'"b":')  # the key ends inside the token
    assert not keys.would_repeat(b'"c"')
    keys.feed(b'"s\\"')  # an escaped quote does not end the key
    assert not keys.would_repeat(b"q")
    assert keys.would_repeat(b"") is False
    keys.feed(b'":[{"a":"}"}],')  # a brace inside a string closes nothing
    assert keys.would_repeat(b'"s\\""')
    assert keys.would_repeat(b'"a"')  # back in the outer object, which has "a"


def test_the_sampler_passes_over_a_token_that_repeats_a_key() -> None:
    guidance = json_guidance(ANY_JSON_OBJECT)
    request = GenerationRequest([1], 10, guidance=(guidance.kind, guidance.grammar))
    start = grammar_start(Vocabulary.of(BYTES, frozenset({EOS})), guidance.kind, guidance.grammar)
    row = RowSampler(request, frozenset({EOS}), BYTES.vocab_size, start)
    for token in BYTES.tokenize_str('{"a":1,"a'):
        row.accept(token)
    scores = np.zeros(BYTES.vocab_size, np.float32)
    scores[ord('"')] = 5.0  # the model wants to end the key: "a" again
    scores[ord("b")] = 4.0
    assert row.choose(scores.copy(), 3) == ord("b")
    row.accept(ord("b"))
    assert row.choose(scores.copy(), 4) == ord('"')  # "ab" is a new key


def test_the_sampler_reads_the_bytes_of_the_token_it_chose_once() -> None:
    guidance = json_guidance(ANY_JSON_OBJECT)
    request = GenerationRequest([1], 10, guidance=(guidance.kind, guidance.grammar))
    start = grammar_start(Vocabulary.of(BYTES, frozenset({EOS})), guidance.kind, guidance.grammar)
    row = RowSampler(request, frozenset({EOS}), BYTES.vocab_size, start)
    read: list[int] = []
    real = row._token_bytes

    def counted(token: int) -> bytes:
        read.append(token)
        return real(token)

    row._token_bytes = counted  # type: ignore[method-assign]
    for token in BYTES.tokenize_str('{"a":1,"'):
        row.accept(token)  # replayed: not chosen, so read when accepted
    assert len(read) == len('{"a":1,"')
    read.clear()
    scores = np.zeros(BYTES.vocab_size, np.float32)
    scores[ord("b")] = 5.0
    token = row.choose(scores.copy(), 8)
    row.accept(token)
    assert read == [ord("b")]
    row.choose(scores.copy(), 9)
    row.accept(ord("c"))  # a replay going on with another token than the one chosen
    assert read == [ord("b"), ord("b"), ord("c")]
