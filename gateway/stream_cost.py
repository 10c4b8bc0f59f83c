"""What a job's token stream keeps in Redis, as the gateway estimates it at submission (counted against the
key's ORTFLEET_KEY_MAX_STREAM_BYTES_IN_FLIGHT): about 64 bytes a generated token, and with log-probabilities
64 more for the token's own and 96 for each of its top alternatives, about 2 KB a token at 20. A stream
keeps its entries for the job TTL after the job ends; the bound holds only while the job is active."""

from __future__ import annotations

from common.wire import JobSpec

TOKEN_BYTES = 64  # a token entry: its text, ids and index, and Redis's own cost of an entry
LOGPROB_BYTES = 64  # the token's own log-probability: token, logprob, bytes
ALTERNATIVE_BYTES = 96  # each likeliest alternative given with it


def bytes_per_token(logprobs: int | None) -> int:
    """A generated token's share of its stream, with `logprobs` alternatives (None: no log-probabilities)."""
    if logprobs is None:
        return TOKEN_BYTES
    return TOKEN_BYTES + LOGPROB_BYTES + ALTERNATIVE_BYTES * logprobs


def estimated_stream_bytes(spec: JobSpec, prompt_tokens: int) -> int:
    """The bytes the job's stream will keep: its max_tokens, and its prompt when it asks for the prompt's
    log-probabilities (`prompt_tokens`, as estimated)."""
    sampling = spec.sampling
    generated = (sampling.max_tokens or 0) * bytes_per_token(sampling.logprobs)
    if sampling.prompt_logprobs is None:
        return generated
    return generated + prompt_tokens * (LOGPROB_BYTES + ALTERNATIVE_BYTES * sampling.prompt_logprobs)
