"""The worker's settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from common.settings import FleetSettings


class WorkerSettings(FleetSettings):
    """Settings of a generation worker (command-line flags override them)."""

    model: Path | None = Field(None, description="ORT-GenAI model folder to serve (--model).")
    device: str = Field("auto", description="Device: auto, cpu, cuda or cuda:N (--device).")
    name: str | None = Field(
        None, description="Served model name (--name); defaults to the model folder's name."
    )
    max_batch_size: int | None = Field(
        None,
        ge=1,
        description="Engine batch rows (requests generated together); default 8 on ortfleet's batcher, "
        "sized from the card on a GPU (see target_itl_ms), else from genai_config (og.Engine's static "
        "scheduler's default is 4).",
    )
    target_itl_ms: float = Field(
        12.0,
        gt=0,
        description="On a GPU (og.Engine's dynamic batching), when max_batch_size is not set: the "
        "inter-token latency the worker sizes its rows for. At start it times decode steps at 1, 2, 4, "
        "... rows up to what the KV memory allows at the full context (at most 256) and serves with the "
        "most rows whose step takes at most half of it, the other half left to its own work on each "
        "step's tokens (detokenizing, stop strings, stream writes). The chosen rows and the timings are "
        "logged.",
    )
    gpu_kv_fraction: float | None = Field(
        None,
        gt=0,
        le=0.95,
        description="On a GPU: the share of the card's whole memory this worker's paged KV cache takes "
        "(pins genai_config's num_blocks). Set it when several workers with engines of their own share "
        "one GPU, each to its share (workers on one shared engine core need none: the core holds one "
        "cache; for a shared core, the core reads it). Default: og's own rule, genai_config's "
        "gpu_utilization_factor (0.6 when absent) of the memory free once the weights are loaded.",
    )
    cuda_graph: Literal["auto", "on", "off"] = Field(
        "auto",
        description="On a GPU: whether decode steps replay captured CUDA graphs. For og.Engine, written "
        "as the CUDA provider option enable_cuda_graph of the config the worker loads: auto (the "
        "default) on for models with paged attention (og.Engine's dynamic batching replays a graph for "
        "each pure-decode step shape and runs prefill and mixed steps eagerly; on an H200 the default "
        "model's one-row decode step took 1.3 ms against 4.0 eager), off for the others; on: on for "
        "every CUDA model. For ortfleet's paged engine (--scheduler paged): auto and on capture a graph "
        "per bucket of pure-decode runs (rows padded to a power of two up to 256, block tables to a "
        "power-of-two width), prefill and mixed runs eager; a worker serving LoRA adapters, or whose "
        "session refuses graphs (a warning says why), runs eagerly. off: never (a model that fails to "
        "load or capture with graphs, or the graphs' memory beside the KV cache too much for the card). "
        "Never set on the CPU.",
    )
    engine_core: str = Field(
        "auto",
        description="Where the engine runs: off (a thread of the worker's own process), process (an "
        "engine-core process the worker starts as its child: the engine's steps and the worker's "
        "per-token work no longer share one interpreter), unix:PATH (a shared engine core serving "
        "several workers, started with `python -m worker.core --socket PATH --frontends N`; each "
        "worker takes its share of the engine's rows) or auto (process on a GPU, off on the CPU). "
        "With process or unix:PATH, the core's death ends its rows as lost: their jobs resume as after "
        "a worker's death, and the worker starts a new core (process) or waits for one (unix:PATH, up "
        "to engine_core_wait_s).",
    )
    engine_core_stall_s: float = Field(
        30.0,
        gt=0,
        description="An engine core drops a worker that takes none of its steps for this long while steps "
        "wait for it (paused, or hung), as if it had died: its rows are cancelled and its jobs resume "
        "elsewhere, and it cannot hold back the engine and the other workers of a shared core. Read by "
        "the core.",
    )
    engine_core_wait_s: float = Field(
        600.0,
        gt=0,
        description="How long a worker waits for its engine core to load the model and answer (process), "
        "or for a shared core to listen at its path (unix:PATH), at start and after the core exits.",
    )
    scheduler: Literal["auto", "batcher", "og-engine", "paged"] = Field(
        "auto",
        description="What batches the requests: batcher (ortfleet's continuous batcher: requests join "
        "and leave at every step, chunked prefill; CPU only), og-engine (ORT-GenAI's og.Engine: dynamic "
        "batching where the model has paged attention, else its static scheduler), paged (ortfleet's "
        "own scheduler over a pool of KV blocks: on a GPU, the model built with paged attention, with the "
        "batcher's parameters, logprobs, penalties and logit_bias among them; not yet the default there: "
        "the engine has not run on a card; on the CPU, the model's own graph through the same block "
        "tables, the batcher's tokens at a higher cost per step) or auto (og.Engine "
        "where the model has paged attention or the device is a GPU, the batcher elsewhere).",
    )
    sampling: Literal["host", "graph"] = Field(
        "host",
        description="On the paged engine (scheduler paged): where each row's next token is picked. host: "
        "RowSampler, row by row, on the logits copied to the host; graph: the sampler graph, one "
        "onnxruntime run for every row it can serve on the engine's device (greedy, temperature, top_k, "
        "top_p, penalties, logit_bias, min_tokens, log-probabilities), RowSampler for the others "
        "(grammars, and rows whose pick it cannot make exactly as RowSampler would). Its step on an "
        "H200 took 70 ms at 256 rows, not yet faster than the host.",
    )
    kv_budget_tokens: int | None = Field(
        None,
        ge=1,
        description="On the batcher: tokens of KV cache the running requests may hold together (each "
        "reserves its prompt plus max_tokens when it starts; requests wait for room). Default: batch "
        "rows x the model's context. A token costs 2 x layers x KV heads x head size x 4 bytes "
        "(46 KB on the default model).",
    )
    prefill_chunk_tokens: int = Field(
        128,
        ge=16,
        le=8192,
        description="On the batcher: the most prompt tokens prefilled between two decode steps; a "
        "longer prompt is prefilled a chunk at a time, so the running requests keep generating (one "
        "token per chunk while it prefills). Prompt prefixes are reused in whole chunks. Larger: long "
        "prompts prefill a little faster; smaller: running requests stall less.",
    )
    prefix_cache: bool = Field(
        True,
        description="On the batcher: a finished request's prompt KV stays in its free slot, and a request "
        "whose prompt starts the same way (whole prefill chunks) prefills only the rest; its tokens are "
        "the same as without the cache.",
    )
    lora_modules: dict[str, Path] = Field(
        default_factory=dict,
        description="LoRA adapters the worker serves beside its model, as JSON: "
        '{"name": "/path/to/adapter", ...} (--lora NAME=PATH, once per adapter), each a PEFT folder '
        "(adapter_config.json, adapter_model.safetensors). A request whose model is an adapter's name runs "
        "on a worker of this model with that adapter. Only ortfleet's batcher and its paged engine serve "
        "adapters; an adapter that does not fit the model stops the worker at start, naming why. Every "
        "worker of a served name "
        "must be given the same adapter names; it also loads those loaded into its model at run time "
        "(POST /v1/load_lora_adapter).",
    )
    verify_weights: bool = Field(
        True,
        description="At start, check every file the model folder's build marker lists against its sha256, "
        "weights included, and refuse a folder whose files differ, naming them (the default model's 86 MB "
        "take about 0.25 s; about 3 s a GB). Off, only files up to 8 MB (configs, tokenizer) are hashed "
        "and the others checked by size: for huge models whose folders are known good.",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        description="Worker deaths a job may cause in quarantine (running alone on its worker, after a "
        "first death made it suspect) before it fails as poison; stopped or drained workers never count.",
    )
    resume_mode: Literal["replay", "prefill"] = Field(
        "replay",
        description="How a job resumes from the tokens already streamed: replay (recompute them one "
        "decode step each, as first computed: greedy text equals an uninterrupted run's) or prefill "
        "(one prefill of prompt and tokens: faster, but the text may differ after the resume point).",
    )
    crash_marker: str = Field(
        "",
        description="Testing aid: a worker kills itself (SIGKILL) when it starts a job whose prompt "
        "holds this text, as an engine crash would (a poison job); empty is off.",
    )
    fail_marker: str = Field(
        "",
        description="Testing aid: a worker fails a job whose prompt holds this text with error code "
        "job_failed, as it fails a job its engine could not run; empty is off.",
    )
    claim_poll_s: float = Field(
        1.0,
        gt=0,
        description="Fallback poll of the queue; new jobs wake idle workers at once through Redis pub/sub.",
    )
    shutdown_grace_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, seconds running jobs get to finish before the rest are handed back "
        "to the queue (they resume on another worker from the tokens already streamed).",
    )
    step_delay_s: float = Field(
        0.0,
        ge=0,
        le=10,
        description="Testing aid: pause this long after each engine step to act as a slower device "
        "(fault drills, balancing experiments); 0 is off.",
    )
    static_batch_window_s: float = Field(
        0.02,
        ge=0,
        le=1,
        description="On the static scheduler (a batch runs to its end before it admits anyone): the "
        "longest a worker waits for the jobs it expects (as many as its last batch had) before it "
        "starts a batch with fewer; otherwise, for jobs submitted together with the first, until a tenth "
        "of it has passed since that one's submission; 0 starts at once.",
    )
    publish_max_batch: int = Field(
        64, ge=1, description="Most tokens written to a job's stream in one Redis round trip."
    )
    stream_interval: int = Field(
        1,
        ge=1,
        le=64,
        description="A job's tokens go to its stream this many at a time (its first token, and what is "
        "left when it ends, at once). 1 streams every engine step's tokens as they come; more cuts the "
        "fleet's CPU per token (Redis writes, relay reads and client writes per step) and makes streams "
        "burstier: a client gets n tokens every n steps.",
    )
    stream_writes_per_s: float = Field(
        2000.0,
        gt=0,
        description="Job stream writes a second the worker aims at. Redis' work goes per write of a job "
        "(about the same whether it carries one token or ten). While the worker's jobs together make "
        "more token entries a second than this (one a job and engine step: a GPU's many rows), a job's "
        "tokens wait to go to its stream together, as one entry: up to (jobs streaming) / this seconds, "
        "at most ORTFLEET_STREAM_COALESCE_MS. A job's first token, and anything a reader waits for, "
        "never waits. Below this rate every step's tokens go out at once, so a stream's inter-token "
        "latency is the engine's step time.",
    )
    stream_coalesce_ms: float = Field(
        50.0,
        ge=0,
        le=1000,
        description="The longest a job's tokens wait to go to its stream together "
        "(ORTFLEET_STREAM_WRITES_PER_S); a client then gets the tokens of a few steps at once. 0 writes "
        "every step's tokens as they come, whatever the rate.",
    )
    preempt_batch: bool = Field(
        True,
        description="Batch jobs yield to interactive ones: when interactive jobs wait and no slot is free, "
        "a worker sends batch jobs back to the queue (they resume later from their streamed tokens; "
        "not an attempt). On the static scheduler this cuts the whole batch.",
    )
    preempt_after_s: float = Field(
        0.01,
        ge=0,
        le=60,
        description="How long interactive jobs wait (for a worker with a free slot) before a worker full "
        "of batch jobs preempts them.",
    )
    preempt_for_keys: bool = Field(
        True,
        description="Keys share a worker's rows: a key's share is the worker's rows in proportion to its "
        "weight among the keys that hold a row or wait for one. When no row is free and another key's "
        "interactive job has waited ORTFLEET_PREEMPT_FOR_KEYS_AFTER_S, wherever it stands in the queue, "
        "and its key holds less than its share, a worker on continuous batching preempts an interactive "
        "job of the key furthest above its share (the one preempted fewest times, then the one that "
        "loses fewest tokens; none within ORTFLEET_PREEMPT_PROTECT_S of resuming from a preemption) and "
        "gives the freed row to the waiting job. The preempted job goes back to the queue in its place "
        "and resumes from its streamed tokens (not an attempt).",
    )
    preempt_for_keys_after_s: float = Field(
        0.5,
        ge=0,
        le=600,
        description="How long another key's interactive job waits in the queue before a worker preempts "
        "for it (ORTFLEET_PREEMPT_FOR_KEYS); a preempted job prefills its prompt again.",
    )
    preempt_protect_s: float = Field(
        5.0,
        ge=0,
        le=3600,
        description="A job resumed after a preemption runs this long before a worker may preempt it for "
        "another key again (ORTFLEET_PREEMPT_FOR_KEYS), so that no job is preempted again and again.",
    )
    store: int = Field(
        0,
        ge=0,
        description="Which of its model's Redis stores the worker serves, when ORTFLEET_REDIS_SHARDS gives "
        "the model several (1 the first listed, ...; --store). 0: the one with the fewest live workers "
        "of the model when the worker starts (a tie is broken at random), among those that answer: one "
        "that does not is passed over with a warning, while one that refuses its URL (a Redis Cluster "
        "node, a wrong password) or evicts keys stops the worker, naming it (store 2, ...).",
    )
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of the worker's Prometheus /metrics (--metrics-port); 0 picks a free one. The "
        "URL is in the worker's registry entry (`ortfleet status` shows it).",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="Address the worker's /metrics listens on; 0.0.0.0 to be scraped from other hosts.",
    )

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_flags(cls, value: Any) -> Any:
        """--lora's NAME=PATH strings, as the JSON map the variable gives."""
        if not isinstance(value, list):
            return value
        modules: dict[str, str] = {}
        for given in value:
            name, equals, path = str(given).partition("=")
            if not equals or not name.strip() or not path.strip():
                raise ValueError(f"must be NAME=PATH, not {given!r}")
            if name.strip() in modules:
                raise ValueError(f"names adapter {name.strip()!r} twice")
            modules[name.strip()] = path.strip()
        return modules

    @field_validator("lora_modules")
    @classmethod
    def _lora_names(cls, modules: dict[str, Path]) -> dict[str, Path]:
        for name in modules:
            if not name or name != name.strip():
                raise ValueError(
                    f"an adapter's name must be non-empty text without surrounding spaces: {name!r}"
                )
        return modules

    @field_validator("engine_core")
    @classmethod
    def _engine_core(cls, value: str) -> str:
        value = value.strip()
        if value.lower() in ("auto", "off", "process"):
            return value.lower()
        if value.startswith("unix:") and len(value) > len("unix:"):
            return value
        raise ValueError(f"must be auto, off, process or unix:PATH, not {value!r}")

    def engine_core_mode(self, device_kind: str) -> str:
        """off, process or unix:PATH for a worker on a device of this kind (auto resolved)."""
        if self.engine_core == "auto":
            return "process" if device_kind == "cuda" else "off"
        return self.engine_core
