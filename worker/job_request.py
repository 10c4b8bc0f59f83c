"""What a claimed job asks of the engine: its prompt's token ids, and the request that generates the rest
of it (after what earlier attempts streamed), or why it cannot run."""

from __future__ import annotations

import json

from common.error_codes import ErrorCode
from common.wire import JobSpec
from worker.engine import Engine, GenerationRequest, Tokenizer


class PromptTooLong(ValueError):
    code = ErrorCode.context_length_exceeded


class GuidedResume(ValueError):
    """A structured-output job cannot go on from tokens an earlier attempt streamed on og.Engine, whose
    grammar would start again from its beginning (ortfleet's batcher replays them through it)."""

    code = ErrorCode.structured_output_not_resumable


class NeedsLogits(ValueError):
    """The job asks for logprobs, penalties or a logit bias, and the engine exposes no logits."""

    code = ErrorCode.unsupported_parameter


def prompt_ids(spec: JobSpec, tokenizer: Tokenizer) -> list[int]:
    if spec.messages is not None:
        messages = json.dumps([m.model_dump() for m in spec.messages])
        text = tokenizer.apply_chat_template(messages)
    else:
        assert spec.prompt is not None
        text = spec.prompt
    return tokenizer.encode(text)


def engine_request(
    spec: JobSpec,
    prompt_ids: list[int],
    done: list[int],
    engine: Engine,
    *,
    replay: bool,
    cancelled: bool,
    owner: str = "",
    weight: float = 1.0,
) -> GenerationRequest | None:
    """What to ask the engine for, after the `done` tokens earlier attempts streamed (`replay`: replayed,
    else prefilled with the prompt); None when nothing is left to generate (or the job was cancelled)."""
    context = engine.context_length
    if len(prompt_ids) >= context:
        raise PromptTooLong(
            f"the prompt is {len(prompt_ids)} tokens, but model {spec.model!r} has a context of "
            f"{context} tokens (prompt and generated tokens together)"
        )
    sampling = spec.sampling
    wanted = (sampling.max_tokens or context) - len(done)
    room = context - len(prompt_ids) - len(done)
    max_new = max(0, min(wanted, room))
    if cancelled or max_new == 0:
        return None
    guidance = spec.guidance
    if guidance is not None and done and not (replay and engine.replays_guidance):
        raise GuidedResume(
            f"the worker running this structured-output job stopped after {len(done)} "
            "tokens, and structured output cannot resume from them; submit the job again"
        )
    fewest = max_new if sampling.ignore_eos else sampling.min_tokens - len(done)
    request = GenerationRequest(
        prompt_ids=prompt_ids if replay else prompt_ids + done,
        replay_ids=tuple(done) if replay else (),
        max_new_tokens=max_new,
        min_new_tokens=max(0, min(fewest, max_new)),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,
        stop=None if sampling.include_stop_str_in_output else sampling.stop,  # kept: matched by the job
        repetition_penalty=sampling.repetition_penalty,
        guidance=(guidance.kind, guidance.grammar) if guidance is not None else None,
        close_early=sampling.close_early,
        logprobs=sampling.logprobs,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        logit_bias=tuple(sorted((sampling.logit_bias or {}).items())),
        prompt_logprobs=sampling.prompt_logprobs,
        cache_scope=spec.cache_scope,
        adapter=spec.adapter,
        owner=owner,
        weight=weight,
    )
    needed = request.needs_logits
    if needed is not None and not engine.exposes_logits:
        raise NeedsLogits(
            f"{needed}: the workers of model {spec.model!r} run og.Engine, which exposes no logits; "
            "only workers running ortfleet's batcher (ORTFLEET_SCHEDULER) honour logprobs, "
            "presence_penalty, frequency_penalty and logit_bias"
        )
    return request
