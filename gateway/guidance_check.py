"""Structured-output grammars checked before they reach a shared engine.

ORT-GenAI runs llguidance inside og.Engine with llguidance's default limits, and on the static scheduler
a grammar that exceeds one of them in the middle of a batch leaves the whole engine unusable. So the
gateway compiles each grammar with llguidance itself, under limits a fifth of the engine's, and walks a
few paths through it for up to `PROBE_BYTES` bytes, as the engine would generate them: computing each
step's mask and the bytes the grammar forces after each one. A grammar that needs more than these limits
anywhere on those paths is refused with a 400 that names the limit; one the compiler rejects is refused
with its message. The engine's worker still guards against what a probe cannot reach (see
worker/service.py: engine recovery).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper

from common.guidance import Guidance

# llguidance's defaults, which ORT-GenAI's engine runs with (it exposes none of them).
ENGINE_LIMITS = {
    "step_max_items": 50_000,
    "step_lexer_fuel": 200_000,
    "initial_lexer_fuel": 1_000_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
}
# What a grammar may need here: a fifth of each, so that what passes on the probe's byte vocabulary keeps
# a wide margin on the model's (larger) vocabulary and on the engine's older llguidance.
CHECK_LIMITS = {name: limit // 5 for name, limit in ENGINE_LIMITS.items()}
PROBE_BYTES = 256  # how far each path is walked
PROBE_PATHS = 3  # lowest allowed byte first, highest, pseudo-random

# llguidance's message when a limit is hit -> the limit, and what it bounds.
_LIMIT_ERRORS = (
    ("Too many items", "step_max_items", "parser items in one step"),
    ("too many expressions constructed", "step_lexer_fuel", "lexer work in one step"),
    ("too many states", "max_lexer_states", "lexer states"),
    ("grammar size", "max_grammar_size", "grammar symbols"),
    ("initial lexer configuration", "initial_lexer_fuel", "lexer work to compile it"),
    ("fuel exhausted", "initial_lexer_fuel", "lexer work to compile it"),
    ("lexer precomputation failed", "initial_lexer_fuel", "lexer work to compile it"),
)
_EOS = 255  # the probe's vocabulary: bytes 0-254 (0xff never occurs in UTF-8) and an end token


@dataclass(frozen=True)
class GuidanceProblem:
    """Why a grammar cannot go to the engine: `limit` names the limit it exceeds (None: it is invalid)."""

    message: str
    limit: str | None = None


class _ByteVocabulary:
    eos_token_id = _EOS
    bos_token_id = None
    tokens = [bytes([b]) for b in range(_EOS)] + [b"<eos>"]
    special_token_ids = [_EOS]

    def __call__(self, text: Any) -> list[int]:
        return list(text if isinstance(text, bytes) else str(text).encode())


@functools.cache
def _tokenizer() -> LLTokenizer:
    return LLTokenizer(TokenizerWrapper(_ByteVocabulary()))


def _limits() -> LLParserLimits:
    return LLParserLimits(
        step_max_items=CHECK_LIMITS["step_max_items"],
        step_lexer_fuel=CHECK_LIMITS["step_lexer_fuel"],
        initial_lexer_fuel=CHECK_LIMITS["initial_lexer_fuel"],
        max_lexer_states=CHECK_LIMITS["max_lexer_states"],
        max_grammar_size=CHECK_LIMITS["max_grammar_size"],
        verbose_errors=False,
    )


@functools.lru_cache(maxsize=512)
def guidance_problem(kind: str, grammar: str) -> GuidanceProblem | None:
    """What keeps this grammar from the engine; None when it may go. Blocking (milliseconds; run it off
    the event loop). Results are cached: clients tend to send the same schema again and again."""
    try:
        compiled = _compiled(kind, grammar)
    except ValueError as e:
        return _problem(kind, str(e))
    failed, messages = LLMatcher.validate_grammar_with_warnings(compiled, _tokenizer(), limits=_limits())
    if failed:
        return _problem(kind, messages[0])
    for path in range(PROBE_PATHS):
        error = _walk(compiled, path)
        if error:
            return _problem(kind, error)
    return None


def _compiled(kind: str, grammar: str) -> str:
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(grammar)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(grammar)
    return LLMatcher.grammar_from_lark(grammar)


def _walk(compiled: str, path: int) -> str:
    """Generates up to PROBE_BYTES bytes the grammar allows, as the engine steps: the forced bytes, the
    mask, one byte; returns llguidance's error, or "" when none came up."""
    matcher = LLMatcher(_tokenizer(), compiled, limits=_limits(), log_level=0)
    pick = random.Random(path)
    for _ in range(PROBE_BYTES):
        matcher.compute_ff_bytes()
        mask = matcher.compute_bitmask() if not matcher.is_error() else b""
        if matcher.is_error() or matcher.is_stopped():
            break
        allowed = [b for b in range(_EOS) if mask[b >> 3] >> (b & 7) & 1]
        if not allowed:
            break
        byte = allowed[0] if path == 0 else allowed[-1] if path == 1 else pick.choice(allowed)
        if not matcher.consume_token(byte):
            break
    return matcher.get_error()


def _problem(kind: str, error: str) -> GuidanceProblem:
    error = error.split("<state>")[0].replace("<non-verbose/>", "")
    detail = " ".join(line.strip() for line in error.splitlines() if line.strip())
    for marker, limit, what in _LIMIT_ERRORS:
        if marker in error:
            return GuidanceProblem(
                f"this {kind} is too complex for the engine: it needs more {what} than the limit "
                f"{limit} allows ({CHECK_LIMITS[limit]:,}): {detail[:300]}",
                limit,
            )
    return GuidanceProblem(f"the engine cannot use this {kind}: {detail[:500]}")


def check(guidance: Guidance) -> GuidanceProblem | None:
    return guidance_problem(guidance.kind, guidance.grammar)
