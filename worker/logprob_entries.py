"""Each generated token's log-probabilities as a job's token events carry them: OpenAI's chat shape,
with each token id turned into its text by the model's tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker.engine import Tokenizer, TokenLogprobs


class LogprobEntries:
    """Builds the entries of one job's tokens. A token's `bytes` are its own; its `token` is their text,
    or, for a token that holds part of a character, `bytes:` and the bytes escaped (`bytes:\\xe2\\x80`),
    as OpenAI writes such tokens. Each token is looked up once per job."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._tokens: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
        return [
            {
                **self._entry(token, found.logprob),
                "top_logprobs": [self._entry(other, logprob) for other, logprob in found.top],
            }
            for token, found in zip(token_ids, logprobs, strict=False)
        ]

    def prompt(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
        """The prompt's entries: `logprobs` are those of every token after the first, whose logprob and
        top_logprobs are null."""
        first = {**self._entry(token_ids[0], 0.0), "logprob": None, "top_logprobs": None}
        return [first, *self(token_ids[1:], logprobs)] if token_ids else []

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        known = self._tokens.get(token)
        if known is None:
            raw = self._tokenizer.token_bytes(token)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
            known = self._tokens[token] = (text, list(raw))
        return {"token": known[0], "logprob": logprob, "bytes": known[1]}
