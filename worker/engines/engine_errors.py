"""How the engines' errors read in a job's error: a structured-output grammar an engine refuses, and an
engine failure's cause in one line."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class GuidanceRejected(ValueError):
    """The engine could not compile a request's structured-output grammar."""


@contextlib.contextmanager
def grammar_errors(guidance: tuple[str, str] | None) -> Iterator[None]:
    """Turns the engine's refusal of a request's grammar into GuidanceRejected, naming what it is."""
    try:
        yield
    except Exception as e:
        if guidance is None or "grammar" not in str(e):
            raise
        detail = _one_line(str(e))
        raise GuidanceRejected(grammar_refused(guidance[0], detail)) from e


def grammar_refused(kind: str, detail: str) -> str:
    """A job's error when the engine cannot compile its grammar (a json_schema, regex or lark_grammar)."""
    return f"response_format: the engine cannot use this {kind}: {detail}"


def grammar_broke(kind: str, cause: str) -> str:
    """A job's error when its grammar broke the engine while generating."""
    return f"response_format: the engine failed on this {kind} while generating ({cause})"


def failure_cause(error: str) -> str:
    """The engine's failure in one line: its cause, without llguidance's parser state."""
    return _one_line(error.split("<state>")[0].split("Cause:", 1)[-1])


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())[:500]
