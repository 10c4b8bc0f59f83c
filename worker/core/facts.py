"""What a frontend learns of its engine core when it connects: the engine's facts (rows, context,
capabilities) and the frontend's share of the rows, sent once as the core's first frame (JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import orjson

from worker.engine import Engine


@dataclass(frozen=True)
class CoreFacts:
    capacity: int  # this frontend's share of the engine's rows
    context_length: int
    continuous_batching: bool
    handles_stop_strings: bool
    exposes_logits: bool
    replays_guidance: bool
    closes_documents: bool
    prefix_block_tokens: int
    eos_token_ids: tuple[int, ...]
    kv_budget_tokens: int  # the batcher's (0 elsewhere)
    device: str  # as worker.engines.device.Device prints it
    engine: str  # which engine: "ortfleet's batcher", "og.Engine" or "fake"
    core_pid: int
    frontends: int  # the frontends the core serves at most, each with its share
    model_dir: str  # the folder the core loaded ('' for the fake engine)
    fingerprint: str  # its model's (common/model_folder.py): a frontend checks it serves the same model

    @classmethod
    def of(
        cls,
        engine: Engine,
        share: int,
        *,
        device: str,
        kind: str,
        core_pid: int,
        frontends: int,
        model_dir: str,
        fingerprint: str,
    ) -> CoreFacts:
        return cls(
            capacity=share,
            context_length=engine.context_length,
            continuous_batching=engine.continuous_batching,
            handles_stop_strings=engine.handles_stop_strings,
            exposes_logits=engine.exposes_logits,
            replays_guidance=engine.replays_guidance,
            closes_documents=engine.closes_documents,
            prefix_block_tokens=engine.prefix_block_tokens,
            eos_token_ids=tuple(sorted(engine.eos_token_ids)),
            kv_budget_tokens=int(getattr(engine, "kv_budget_tokens", 0)),
            device=device,
            engine=kind,
            core_pid=core_pid,
            frontends=frontends,
            model_dir=model_dir,
            fingerprint=fingerprint,
        )

    def encode(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def decode(cls, payload: bytes | memoryview) -> CoreFacts:
        fields = orjson.loads(bytes(payload))
        fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
        return cls(**fields)


def shares(capacity: int, frontends: int) -> list[int]:
    """Each frontend's rows out of the engine's `capacity`: as even as they go, the first ones taking
    the remainder; every frontend gets at least one."""
    base, extra = divmod(capacity, frontends)
    return [max(1, base + (i < extra)) for i in range(frontends)]
