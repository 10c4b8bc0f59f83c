"""The batcher's sampling (worker/engines/batcher/sampler.py) on hand-made logits."""

from __future__ import annotations

import numpy as np
import pytest

from worker.engine import GenerationRequest
from worker.engines.batcher.sampler import BiasOutsideVocabulary, RowSampler

pytestmark = pytest.mark.unit

EOS = 9


def sampler(**options: object) -> RowSampler:
    request = GenerationRequest([1, 2, 3], 10, **options)  # type: ignore[arg-type]
    return RowSampler(request, frozenset({EOS}), 10, None)


def logits(*scores: float) -> np.ndarray:
    return np.asarray(scores, np.float32)


def picks(row: RowSampler, scores: np.ndarray, count: int = 400) -> set[int]:
    return {row.choose(scores.copy(), 5) for _ in range(count)}


def test_greedy_takes_the_highest_score_and_a_tiny_temperature_is_greedy() -> None:
    scores = logits(0, 1, 5, 2, 0, 0, 0, 0, 0, 4)
    assert sampler().choose(scores.copy(), 0) == 2
    assert picks(sampler(temperature=1e-9, seed=1), scores) == {2}


def test_top_k_and_top_p_keep_only_the_likeliest_tokens() -> None:
    scores = logits(3, 3, 3, 0, 0, 0, 0, 0, 0, 0)
    assert picks(sampler(temperature=1.0, top_k=2, seed=3), scores) <= {0, 1, 2}
    assert len(picks(sampler(temperature=1.0, top_k=2, seed=3), scores)) == 2
    nucleus = logits(5, 4, 0, 0, 0, 0, 0, 0, 0, 0)  # p(0) ~ 0.72, p(1) ~ 0.27
    assert picks(sampler(temperature=1.0, top_p=0.5, seed=4), nucleus) == {0}
    assert picks(sampler(temperature=1.0, top_p=0.9, seed=4), nucleus) == {0, 1}
    assert len(picks(sampler(temperature=1.0, seed=4), nucleus)) > 2  # no bound: the tail is sampled too


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others() -> None:
    scores = logits(*np.linspace(0, 1, 10))
    first, second = sampler(temperature=1.0, seed=5), sampler(temperature=1.0, seed=5 + 2**31)  # mod 2**31
    other = sampler(temperature=1.0, seed=6)
    a = [first.choose(scores.copy(), 0) for _ in range(50)]
    assert a == [second.choose(scores.copy(), 0) for _ in range(50)]
    assert a != [other.choose(scores.copy(), 0) for _ in range(50)]


def test_min_tokens_mask_the_end_of_sequence_until_reached() -> None:
    scores = logits(0, 0, 0, 0, 0, 0, 0, 0, 1, 9)
    row = sampler(min_new_tokens=3)
    assert row.choose(scores.copy(), 2) == 8
    assert row.choose(scores.copy(), 3) == EOS


def test_the_repetition_penalty_lowers_the_prompts_tokens_and_those_generated() -> None:
    scores = logits(0, 0, 0, 2.0, 1.5, 0, 0, 0, 0, 0)
    assert sampler().choose(scores.copy(), 0) == 3
    row = sampler(repetition_penalty=1.5)
    assert row.choose(scores.copy(), 0) == 4  # 3 is in the prompt: 2.0 / 1.5 < 1.5
    row.accept(4)
    assert row.choose(scores.copy(), 1) == 3  # now 4 was generated: 1.5 / 1.5 < 2.0 / 1.5


def test_frequency_and_presence_penalties_lower_what_was_generated_by_its_count() -> None:
    scores = logits(0, 0, 3.0, 2.6, 0, 0, 0, 0, 0, 0)
    frequency = sampler(frequency_penalty=0.3)
    assert frequency.choose(scores.copy(), 0) == 2
    frequency.accept(2)
    assert frequency.choose(scores.copy(), 1) == 2  # 3.0 - 0.3 still above 2.6
    frequency.accept(2)
    assert frequency.choose(scores.copy(), 2) == 3  # 3.0 - 0.6 below 2.6
    presence = sampler(presence_penalty=0.5)
    presence.accept(2)
    assert presence.choose(scores.copy(), 1) == 3  # once is enough: 3.0 - 0.5
    untouched = sampler(presence_penalty=0.5)
    untouched.accept(4)  # only generated tokens count, not the prompt's (1, 2, 3)
    assert untouched.choose(scores.copy(), 1) == 2


def test_logit_bias_forces_or_bans_a_token_and_one_outside_the_vocabulary_is_refused() -> None:
    scores = logits(0, 0, 3.0, 2.6, 0, 0, 0, 0, 0, 0)
    assert sampler(logit_bias=((6, 100.0),)).choose(scores.copy(), 0) == 6
    assert sampler(logit_bias=((2, -100.0),)).choose(scores.copy(), 0) == 3
    with pytest.raises(BiasOutsideVocabulary, match="token 10 is outside the model's vocabulary of 10"):
        sampler(logit_bias=((10, 1.0),))
