"""A row's next token from its logits, as og.Generator picks it: repetition penalty over the prompt and
what was generated, OpenAI's presence and frequency penalties over what was generated and its logit
bias, end of sequence masked until min_tokens, the grammar's mask (structured output), then greedy, or
temperature, top_k and top_p with the request's own seeded generator. In JSON, a token that would give
an object a key it already has is passed over (json_keys.py).

`choose` picks without changing the row's state (a replay compares the pick with the replayed token);
`accept` records the token the row goes on with (its bytes, decoded by `choose` for the key check, are
read once).
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet

import numpy as np
from llguidance import LLMatcher
from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

from worker.engine import GenerationRequest, TokenLogprobs
from worker.engines.batcher.closing import DocumentCloser
from worker.engines.batcher.grammar_starts import GrammarError, GrammarStart
from worker.engines.batcher.json_keys import JsonKeys
from worker.engines.engine_errors import failure_cause, grammar_broke

_KEY_RETRIES = 64  # tokens passed over at one step for repeating a key, at most
_NUCLEUS_CANDIDATES = 256  # top_p looks at this many likeliest tokens first, the whole vocabulary if need be


class BiasOutsideVocabulary(ValueError):
    """The request's logit_bias names a token the model does not have."""


class RowSampler:
    def __init__(
        self,
        request: GenerationRequest,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        grammar: GrammarStart | None,
    ) -> None:
        self.request = request
        self._eos = np.fromiter(sorted(t for t in eos_token_ids if t < vocab_size), np.int64)
        self.sampling = request.samples
        self._top_k = request.top_k if 0 < request.top_k < vocab_size else 0
        self._random = np.random.default_rng(request.engine_seed)
        self._uniform: float | None = None  # the next sampled pick's draw, when taken ahead (uniform())
        self._penalized: set[int] = set()
        if request.repetition_penalty != 1.0:
            self._penalized.update(request.prompt_ids)
        self._counted = bool(request.presence_penalty or request.frequency_penalty)
        self._counts: dict[int, int] = {}  # each generated token's count, for the two penalties
        outside = [token for token, _ in request.logit_bias if token >= vocab_size]
        if outside:
            raise BiasOutsideVocabulary(
                f"logit_bias: token {outside[0]} is outside the model's vocabulary of {vocab_size} tokens"
            )
        self._bias_ids = np.fromiter((token for token, _ in request.logit_bias), np.int64)
        self._bias = np.fromiter((bias for _, bias in request.logit_bias), np.float32)
        self._matcher: LLMatcher | None = None
        self._bitmask: np.ndarray | None = None
        self._keys: JsonKeys | None = None
        self._chosen: tuple[int, bytes] | None = None  # the token `choose` gave, and its bytes
        self.closer: DocumentCloser | None = None  # ends the document within max_tokens (closing.py)
        if request.guidance is not None:
            assert grammar is not None
            if grammar.matcher is None:
                raise GrammarError(grammar.error or "response_format: the grammar cannot be used")
            self._matcher = grammar.matcher.deep_copy()  # the start's, computed once (grammar_starts.py)
            tokenizer = grammar.vocabulary.tokenizer
            self._bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)
            self._vocab_size = vocab_size
            self._grammar_tokenizer = tokenizer
            if request.guidance[0] == "json_schema":
                self._keys = JsonKeys()
            if request.close_early and self._eos.size and grammar.ending is not None:  # else not closed
                ends = frozenset(map(int, self._eos))
                byte_tokens, json = grammar.vocabulary.byte_tokens, self._keys is not None
                closer = DocumentCloser(self._matcher, byte_tokens, ends, json=json, first=grammar.ending)
                self.closer = closer

    def choose(self, logits: np.ndarray, produced: int, left: int | None = None) -> int:
        """The next token from this step's logits [vocab] (modified in place); `left`: the tokens the row
        may still generate, this one included, within which its document must end (structured output)."""
        self._chosen = None
        if self._penalized:
            ids = np.fromiter(self._penalized, np.int64)
            scores = logits[ids]
            penalty = self.request.repetition_penalty
            logits[ids] = np.where(scores > 0, scores / penalty, scores * penalty)
        if self._counts:
            ids = np.fromiter(self._counts, np.int64, len(self._counts))
            counts = np.fromiter(self._counts.values(), np.float32, len(self._counts))
            logits[ids] -= counts * self.request.frequency_penalty + self.request.presence_penalty
        if self._bias_ids.size:
            logits[self._bias_ids] += self._bias
        if self.masks_eos(produced):
            logits[self._eos] = -np.inf
        if self._matcher is not None:
            self._mask(logits)
        token = self._pick(logits)
        if self._keys is not None:
            token = self._new_key(logits, token)
        if self.closer is not None and left is not None:
            token = self.closer.steer(token, left)
        return token

    def masks_eos(self, produced: int) -> bool:
        """End of sequence is masked at this pick: the row has `produced` tokens, fewer than min_tokens."""
        return produced < self.request.min_new_tokens and self._eos.size > 0

    def _new_key(self, logits: np.ndarray, token: int) -> int:
        """A token that would give an object a key it has is passed over (the grammar leaves others)."""
        assert self._keys is not None
        for _ in range(_KEY_RETRIES):
            piece = self._token_bytes(token)
            if not self._keys.would_repeat(piece):
                self._chosen = (token, piece)
                break
            logits[token] = -np.inf
            token = self._pick(logits)
        return token

    def _pick(self, logits: np.ndarray) -> int:
        if not self.sampling:
            return int(np.argmax(logits))
        return self._sample(logits / self.request.temperature)

    def uniform(self) -> float:
        """The uniform the row's next sampled pick draws with, one per pick from the request's own generator:
        taken now, and used by that pick (by `choose`, or by the sampler graph when it picks, `accept`)."""
        if self._uniform is None:
            self._uniform = self._random.random()
        return self._uniform

    def accept(self, token: int) -> None:
        self._uniform = None
        if self.request.repetition_penalty != 1.0:
            self._penalized.add(token)
        if self._counted:
            self._counts[token] = self._counts.get(token, 0) + 1
        if self._matcher is not None and not self._matcher.consume_token(token):
            raise self._broken()
        chosen, self._chosen = self._chosen, None
        if self._keys is not None or self.closer is not None:
            # the bytes `choose` read, unless a replay (or the closer) goes on with another token
            piece = chosen[1] if chosen is not None and chosen[0] == token else self._token_bytes(token)
            if self._keys is not None:
                self._keys.feed(piece)
            if self.closer is not None:
                self.closer.accept(token, piece)

    def _token_bytes(self, token: int) -> bytes:
        return self._grammar_tokenizer.decode_bytes([token])

    # What the row's pick depends on besides its request, read by the sampler graph's packing
    # (worker/engines/device_sampling/runner.py), which must pick as `pick` does.

    @property
    def top_k(self) -> int:
        """The request's top_k where it narrows the pick (0: every token)."""
        return self._top_k

    @property
    def penalized(self) -> AbstractSet[int]:
        """The tokens repetition_penalty applies to: the prompt's and those generated."""
        return self._penalized

    @property
    def counts(self) -> Mapping[int, int]:
        """Each generated token's count, for presence_penalty and frequency_penalty."""
        return self._counts

    @property
    def bias(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as its token ids (int64) and their biases (float32)."""
        return self._bias_ids, self._bias

    @property
    def closed_early(self) -> bool:
        """The closer overruled the model: the document ended early, within max_tokens."""
        return self.closer is not None and self.closer.acted

    @property
    def closing_off(self) -> bool:
        """The request asked for its document to be closed, and no ending was found to close it with."""
        return self._matcher is not None and self.request.close_early and self.closer is None

    @property
    def grammar_complete(self) -> bool:
        """The grammar's text is complete (it may end here)."""
        return self._matcher is not None and self._matcher.is_accepting()

    @property
    def grammar_done(self) -> bool:
        """The grammar allows nothing more (its text is complete)."""
        return self._matcher is not None and self._matcher.is_stopped()

    def _mask(self, logits: np.ndarray) -> None:
        assert self._matcher is not None and self._bitmask is not None
        fill_next_token_bitmask(self._matcher, self._bitmask)
        if self._matcher.is_error():
            raise self._broken()
        view = logits.reshape(1, -1)
        apply_token_bitmask_inplace(view, self._bitmask[:, : (view.shape[1] + 31) // 32])

    def _broken(self) -> GrammarError:
        assert self._matcher is not None and self.request.guidance is not None
        cause = failure_cause(self._matcher.get_error())
        kind = self.request.guidance[0]
        return GrammarError(grammar_broke(kind, cause))

    def _sample(self, logits: np.ndarray) -> int:
        probabilities = _softmax(logits)
        top_p = self.request.top_p
        if self._top_k:
            order = _likeliest(probabilities, self._top_k)
        elif top_p < 1.0:
            order = _likeliest(probabilities, min(_NUCLEUS_CANDIDATES, probabilities.size))
            if probabilities[order].sum() < top_p:  # the nucleus is wider than the candidates
                order = np.argsort(-probabilities, kind="stable")
        else:
            order = np.arange(probabilities.size)
        weights = probabilities[order]
        if top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(weights), top_p)) + 1
            order, weights = order[:keep], weights[:keep]
        # Over the whole vocabulary the running sum is float64: float32's drifts by up to about 1e-4 of the
        # total over tens of thousands of tokens, wider than a token of a flat softmax, so the pick would
        # depend on the order of the additions (the sampler graph adds in blocks).
        whole = not self._top_k and top_p >= 1.0
        cumulative = np.cumsum(weights, dtype=np.float64) if whole else np.cumsum(weights)
        uniform, self._uniform = self.uniform(), None
        pick = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="right"))
        return int(order[min(pick, order.size - 1)])


def _likeliest(probabilities: np.ndarray, count: int) -> np.ndarray:
    """The `count` likeliest token ids, likeliest first."""
    if count >= probabilities.size:
        return np.argsort(-probabilities, kind="stable")
    candidates = np.argpartition(probabilities, -count)[-count:]
    ordered: np.ndarray = candidates[np.argsort(-probabilities[candidates], kind="stable")]
    return ordered


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """The token's log-probability under these logits, and the `top` likeliest tokens'."""
    shifted = logits.astype(np.float64) - np.max(logits)
    logprobs = shifted - np.log(np.exp(shifted).sum())
    likeliest = _likeliest(logprobs, top) if top else np.empty(0, np.int64)
    return TokenLogprobs(float(logprobs[token]), tuple((int(t), float(logprobs[t])) for t in likeliest))


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - np.max(logits))
    result: np.ndarray = shifted / shifted.sum()
    return result
