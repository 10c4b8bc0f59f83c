"""The shortest ending of a structured document from where its grammar stands
(worker/engines/batcher/closing.py), and the closer that overrules a row's picks only when no ending would fit
its tokens left: on llguidance with a byte-level BPE tokenizer, in-process."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from llguidance import LLMatcher, LLTokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from common.guidance import ANY_JSON_OBJECT, json_guidance
from gateway.openai_api.tools import FunctionDef, ToolPlan
from worker.engines.batcher.closing import START_BUDGET, STEP_BUDGET, DocumentCloser
from worker.engines.batcher.closing_walk import (
    MASK_COST,
    ByteTokens,
    Lexer,
    WalkBudget,
    closing_bytes,
    closing_tokens,
)
from worker.engines.batcher.json_keys import JsonKeys

pytestmark = pytest.mark.unit

END = 0  # the tokenizer's end of sequence

NESTED = {
    "type": "object",
    "properties": {
        "order": {
            "type": "object",
            "properties": {
                "customer": {
                    "type": "object",
                    "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}},
                    "required": ["name", "vip"],
                },
                "lines": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"sku": {"enum": ["a-1", "b-2"]}, "count": {"type": "integer"}},
                        "required": ["sku", "count"],
                    },
                    "minItems": 2,
                },
            },
            "required": ["customer", "lines"],
        },
        "note": {"type": ["string", "null"]},
        "total": {"type": "number", "minimum": 5},
    },
    "required": ["order", "note", "total"],
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> LLTokenizer:
    """A byte-level BPE (as the models' own) trained on a little JSON, so that tokens span several bytes."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [json.dumps(NESTED), '{"name":"Ada","age":36,"tags":["x","y"]}"}]}', "hello world " * 20]
    bpe.train_from_iterator(corpus * 10, trainer=trainer)
    path: Path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    bpe.save(str(path))
    return LLTokenizer(str(path), eos_token=END)


def schema_matcher(tokenizer: LLTokenizer, schema: dict[str, Any]) -> LLMatcher:
    return LLMatcher(
        tokenizer, LLMatcher.grammar_from_json_schema(json_guidance(schema).grammar), log_level=0
    )


def ended(tokenizer: LLTokenizer, matcher: LLMatcher, text: str) -> str:
    """The text after the matcher took it, and the ending found from there."""
    assert matcher.consume_tokens(tokenizer.tokenize_str(text)), matcher.get_error()
    lexer = Lexer()
    lexer.feed(text.encode())
    ending = closing_bytes(matcher, lexer, ByteTokens(tokenizer))
    assert ending is not None
    return text + ending.decode()


def test_an_open_string_and_the_brackets_around_it_are_closed(tokenizer: LLTokenizer) -> None:
    matcher = schema_matcher(tokenizer, ANY_JSON_OBJECT)
    assert ended(tokenizer, matcher, '{"a":[1,{"b":"Ada was born in') == '{"a":[1,{"b":"Ada was born in"}]}'


def test_a_json_object_that_has_not_begun_ends_as_the_empty_object(tokenizer: LLTokenizer) -> None:
    assert ended(tokenizer, schema_matcher(tokenizer, ANY_JSON_OBJECT), "") == "{}"


def test_an_unfinished_number_and_key_get_the_fewest_bytes_that_end_them(tokenizer: LLTokenizer) -> None:
    assert ended(tokenizer, schema_matcher(tokenizer, ANY_JSON_OBJECT), '{"n":12') == '{"n":12}'
    assert ended(tokenizer, schema_matcher(tokenizer, ANY_JSON_OBJECT), '{"ke') == '{"ke":""}'


def test_missing_required_properties_get_minimal_values_recursively(tokenizer: LLTokenizer) -> None:
    for start in (
        "",
        '{"order":{"customer":{"name":"Al',
        '{"order":{"customer":{"name":"Al","vip":false},"lines":[',
    ):
        document = json.loads(ended(tokenizer, schema_matcher(tokenizer, NESTED), start))
        jsonschema.validate(document, NESTED)
        assert len(document["order"]["lines"]) == 2  # minItems minimal items, each with its required keys
    assert json.loads(ended(tokenizer, schema_matcher(tokenizer, NESTED), "")) == {
        "order": {"customer": {"name": "", "vip": True}, "lines": [{"sku": "a-1", "count": 0}] * 2},
        "note": "",
        "total": 5,
    }


def test_a_string_in_an_escape_or_a_character_cut_mid_way_still_ends(tokenizer: LLTokenizer) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    escaped = ended(tokenizer, schema_matcher(tokenizer, schema), '{"s":"a\\')
    assert json.loads(escaped) == {"s": "a\n"}
    matcher = schema_matcher(tokenizer, schema)
    cut = '{"s":"é'.encode()[:-1]  # the first byte of a two-byte character
    assert matcher.consume_tokens(tokenizer.tokenize_bytes(cut))
    lexer = Lexer()
    lexer.feed(cut)
    ending = closing_bytes(matcher, lexer, ByteTokens(tokenizer))
    assert ending is not None and isinstance(json.loads(cut + ending), dict)


def test_a_tool_calls_arguments_and_its_closing_tag_end_the_call(tokenizer: LLTokenizer) -> None:
    weather = FunctionDef(
        name="get_weather",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    )
    response_format = ToolPlan([weather], "required").response_format()
    assert response_format is not None and response_format.grammar is not None
    grammar = LLMatcher.grammar_from_lark(response_format.grammar)
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    text = ended(tokenizer, matcher, '<tool_call>{"name":"get_weather","arguments":{"city":"Par')
    assert text.startswith("<tool_call>") and text.endswith("</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert call["arguments"] == {"city": "Par", "unit": "c"}


def test_the_ending_is_tokens_the_grammar_takes_and_ends_the_document(tokenizer: LLTokenizer) -> None:
    matcher = schema_matcher(tokenizer, NESTED)
    tokens = closing_tokens(matcher, Lexer(), ByteTokens(tokenizer))
    assert tokens is not None
    ending = tokenizer.decode_bytes(tokens)
    assert len(tokens) < len(ending)  # written in tokens of several bytes, not one token a byte
    assert matcher.consume_tokens(tokens) and matcher.is_accepting()
    jsonschema.validate(json.loads(ending), NESTED)


def rambling(tokenizer: LLTokenizer, matcher: LLMatcher) -> int:
    """A model that writes the letter a wherever the grammar lets it, else the first token it allows."""
    letter = tokenizer.tokenize_str("a")[0]
    if matcher.validate_tokens([letter]) == 1:
        return letter
    mask = matcher.compute_bitmask()
    return next(t for t in range(1, tokenizer.vocab_size) if mask[t // 8] >> (t % 8) & 1)


def run_closer(
    tokenizer: LLTokenizer, schema: dict[str, Any], budget: int
) -> tuple[str, bool, list[int], int]:
    """The rambling model's document within `budget` tokens, whether the closer acted, at which steps it
    overruled the model, and the tokens written."""
    matcher = schema_matcher(tokenizer, schema)
    closer = DocumentCloser(matcher, ByteTokens(tokenizer), frozenset({END}), json=True)
    ending = closer.ending()
    assert ending is not None and len(ending) <= budget
    written: list[int] = []
    overruled = []
    for step in range(budget):
        pick = rambling(tokenizer, matcher)
        token = closer.steer(pick, budget - step)
        if token != pick:
            overruled.append(step)
        if token == END:
            break
        assert matcher.consume_token(token)
        closer.accept(token, tokenizer.decode_bytes([token]))
        written.append(token)
        if matcher.is_stopped():
            break
    assert matcher.is_accepting()
    return tokenizer.decode_str(written), closer.acted, overruled, len(written)


def test_the_closer_lets_the_model_write_until_only_the_ending_fits_then_ends_the_document(
    tokenizer: LLTokenizer,
) -> None:
    fewest = closing_tokens(schema_matcher(tokenizer, NESTED), Lexer(), ByteTokens(tokenizer))
    assert fewest is not None
    for spare in (0, 5, 25):
        budget = len(fewest) + spare
        text, acted, overruled, written = run_closer(tokenizer, NESTED, budget)
        jsonschema.validate(json.loads(text), NESTED)
        assert written <= budget
        if spare:
            assert acted and overruled
            assert '"name":"aa' in text  # the model wrote freely first


def test_the_closer_never_acts_where_the_model_ends_within_its_budget(tokenizer: LLTokenizer) -> None:
    bounded = {
        "type": "object",
        "properties": {"s": {"type": "string", "maxLength": 6}},
        "required": ["s"],
        "additionalProperties": False,
    }
    text, acted, overruled, written = run_closer(tokenizer, bounded, 40)
    assert text == '{"s":"aaaaaa"}' and not acted and not overruled
    assert run_closer(tokenizer, bounded, written) == (
        text,
        False,
        [],
        written,
    )  # not even with none to spare


def test_formats_and_lists_whose_first_choice_loops_still_end(tokenizer: LLTokenizer) -> None:
    for text_format, looks_right in (
        ("email", re.compile(r"[^@]+@[^@]+")),
        ("uri", re.compile(r"[a-z]+:.*")),
    ):
        schema = {"type": "object", "properties": {"e": {"type": "string", "format": text_format}}}
        schema["required"] = ["e"]
        for start in ("", '{"e":"ad'):
            document = json.loads(ended(tokenizer, schema_matcher(tokenizer, schema), start))
            assert looks_right.fullmatch(document["e"]), document
    pattern = r"[a-z]+(,[a-z]+)*\."
    regex = LLMatcher(tokenizer, LLMatcher.grammar_from_regex(pattern), log_level=0)
    assert re.fullmatch(pattern, ended(tokenizer, regex, "ab,c"))
    lark = LLMatcher(tokenizer, LLMatcher.grammar_from_lark('start: ITEM ("," ITEM)* ";"\nITEM: /[a-z]+/'))
    assert re.fullmatch(r"[a-z]+(,[a-z]+)*;", ended(tokenizer, lark, "ab"))


def test_the_keys_an_ending_gives_an_object_are_keys_it_does_not_have(tokenizer: LLTokenizer) -> None:
    schema = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 3}
    for start in ("", '{"":1', '{"a":1,"":2,"'):
        matcher = schema_matcher(tokenizer, schema)
        assert matcher.consume_tokens(tokenizer.tokenize_str(start))
        lexer, keys = Lexer(), JsonKeys()
        lexer.feed(start.encode())
        keys.feed(start.encode())
        ending = closing_bytes(matcher, lexer, ByteTokens(tokenizer), keys)
        assert ending is not None
        pairs = json.loads(start + ending.decode(), object_pairs_hook=list)
        assert len(pairs) >= 3 and len({key for key, _ in pairs}) == len(pairs), start + ending.decode()
    fewest = DocumentCloser(
        schema_matcher(tokenizer, schema), ByteTokens(tokenizer), frozenset({END}), json=True
    )
    minimum = fewest.ending()
    assert minimum is not None
    text, acted, _, _ = run_closer(tokenizer, schema, len(minimum))
    pairs = json.loads(text, object_pairs_hook=list)
    assert acted and len({key for key, _ in pairs}) == len(pairs) >= 3
    jsonschema.validate(dict(pairs), schema)


class CountedMatcher:
    """An LLMatcher, and its copies, counting the matcher work done through them: a unit a token checked
    or taken (or a copy), `MASK_COST` a mask."""

    def __init__(self, matcher: LLMatcher, spent: list[int]) -> None:
        self._matcher = matcher
        self.spent = spent

    def deep_copy(self) -> CountedMatcher:
        self.spent[0] += 1
        return CountedMatcher(self._matcher.deep_copy(), self.spent)

    def compute_bitmask(self) -> bytes:
        self.spent[0] += MASK_COST
        return self._matcher.compute_bitmask()  # type: ignore[no-any-return]

    def validate_tokens(self, tokens: list[int]) -> int:
        self.spent[0] += len(tokens)
        return self._matcher.validate_tokens(tokens)  # type: ignore[no-any-return]

    def consume_token(self, token: int) -> bool:
        self.spent[0] += 1
        return self._matcher.consume_token(token)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._matcher, name)


def pattern_schema(pattern: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}


def test_each_step_of_a_costly_pattern_spends_a_bounded_part_of_a_walk(tokenizer: LLTokenizer) -> None:
    """A pattern of 400 characters the walk tries late, filled by a model that picks another of them: a
    fresh walk at every step costs many times a step's budget; the closer stays within it, and lets the
    model write until only the ending fits."""
    schema = pattern_schema("^[~|]{400}$")
    spent = [0]
    matcher = CountedMatcher(schema_matcher(tokenizer, schema), spent)
    byte_tokens = ByteTokens(tokenizer)
    walk = WalkBudget(1 << 40)
    assert closing_bytes(matcher, Lexer(), byte_tokens, budget=walk) is not None  # type: ignore[arg-type]
    assert spent[0] > 3 * STEP_BUDGET  # what one fresh walk costs
    closer = DocumentCloser(matcher, byte_tokens, frozenset({END}), json=True)  # type: ignore[arg-type]
    ending = closer.ending()
    assert ending is not None
    budget = len(ending) + 60
    tilde, opening = tokenizer.tokenize_str("~")[0], tokenizer.tokenize_str('{"s":"')
    most, overruled, written = 0, [], 0
    for step in range(budget):
        pick = opening[step] if step < len(opening) else tilde
        if matcher.validate_tokens([pick]) != 1:  # the pattern is full: the quote and the brace
            pick = next(t for t in tokenizer.tokenize_str('"}') if matcher.validate_tokens([t]) == 1)
        spent[0] = 0
        token = closer.steer(pick, budget - step)
        most = max(most, spent[0])
        if token == END:
            break
        overruled += [step] if token != pick else []
        assert matcher.consume_token(token)
        closer.accept(token, tokenizer.decode_bytes([token]))
        written += 1
        if matcher.is_stopped():
            break
    assert most <= STEP_BUDGET + 2 * len(ending), most
    assert matcher.is_accepting() and written <= budget
    assert not overruled or min(overruled) >= budget - len(ending) - 2  # only where nothing else fits


def test_a_grammar_whose_first_ending_costs_more_than_its_budget_is_not_closed(
    tokenizer: LLTokenizer,
) -> None:
    spent = [0]
    matcher = CountedMatcher(schema_matcher(tokenizer, pattern_schema("^[~|]{4000}$")), spent)
    closer = DocumentCloser(matcher, ByteTokens(tokenizer), frozenset({END}), json=True)  # type: ignore[arg-type]
    assert closer.ending() is None
    assert spent[0] <= START_BUDGET + MASK_COST + 64


def test_a_long_ending_of_many_items_never_makes_the_closer_act_before_it_must(
    tokenizer: LLTokenizer,
) -> None:
    """Forty required items (an ending of hundreds of tokens): each step's walk stays within its budget, so
    the model writes freely until only the ending fits."""
    item = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}}
    item["required"] = ["name", "n"]
    schema = {"type": "object", "properties": {"lines": {"type": "array", "items": item, "minItems": 40}}}
    schema["required"] = ["lines"]
    fewest = closing_tokens(schema_matcher(tokenizer, schema), Lexer(), ByteTokens(tokenizer), JsonKeys())
    assert fewest is not None and len(fewest) > 200
    spare = 30
    text, acted, overruled, written = run_closer(tokenizer, schema, len(fewest) + spare)
    jsonschema.validate(json.loads(text), schema)
    assert acted and min(overruled) >= spare and written <= len(fewest) + spare
