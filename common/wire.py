"""The wire formats shared by gateway and workers: job requests and specs, the job as the API shows it,
stream event types. The job's record in Redis is common/jobs/record.py's."""

from __future__ import annotations

import math
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from common.guidance import Guidance, ResponseFormat


class JobStatus(str, Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


TERMINAL = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})


class PriorityClass(str, Enum):
    """A job's priority class: a worker claims interactive jobs before any batch job, and batch work
    yields its engine slots to waiting interactive jobs."""

    interactive = "interactive"
    batch = "batch"


# Highest class first: the order in which workers claim.
PRIORITY_ORDER = (PriorityClass.interactive, PriorityClass.batch)


class FinishReason(str, Enum):
    stop = "stop"  # end of sequence or a stop string
    length = "length"  # max_tokens reached (or the model's context)
    cancelled = "cancelled"
    error = "error"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


def with_system_text(messages: list[ChatMessage], text: str) -> list[ChatMessage]:
    """The conversation with `text` at the end of its leading system message (one is put first if none)."""
    if messages and messages[0].role == "system":
        first = ChatMessage(role="system", content=messages[0].content + "\n\n" + text)
        return [first, *messages[1:]]
    return [ChatMessage(role="system", content=text), *messages]


MAX_CACHE_SALT = 256
CACHE_SALT = (
    "As vLLM's: requests reuse each other's cached prompt prefixes only when their salts are equal (and "
    "they share a cache scope: the same API key, unless the operator shares one). A long random salt, "
    "kept secret, keeps a prompt's prefix from any request that does not send it. 1 to "
    f"{MAX_CACHE_SALT} characters."
)
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries
TokenId = Annotated[int, Field(ge=0)]
MAX_BIAS = 100.0  # OpenAI's bound on a logit_bias value, either way


def _bias(value: float) -> float:
    if not (math.isfinite(value) and -MAX_BIAS <= value <= MAX_BIAS):
        raise ValueError(f"must be a finite number between -{MAX_BIAS:g} and {MAX_BIAS:g}")
    return value


LogitBias = Annotated[
    float, AfterValidator(_bias), Field(json_schema_extra={"minimum": -100, "maximum": 100})
]

StopList = Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=16)]


class Sampling(BaseModel):
    """How tokens are chosen; temperature 0 means greedy."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int | None = Field(None, ge=1, le=131_072, description="Most tokens to generate.")
    min_tokens: int = Field(
        0,
        ge=0,
        le=131_072,
        description="Fewest tokens to generate: end of sequence is masked until then (stop strings still "
        "apply); at most max_tokens.",
    )
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 picks the most likely token.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling bound.")
    top_k: int = Field(0, ge=0, le=1000, description="Sample among the k most likely tokens; 0 is off.")
    seed: int | None = Field(
        None,
        ge=0,
        le=2**63 - 1,
        description="Seed for reproducible sampling. ORT-GenAI takes 31-bit seeds: the engine samples with "
        "seed modulo 2^31, so seeds 2^31 apart sample alike.",
    )
    stop: StopList | None = Field(None, description="Strings that end generation (not included in output).")
    # vLLM's sampling extensions.
    ignore_eos: bool = Field(False, description="Generate exactly max_tokens: end of sequence is masked.")
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=2.0, description="Above 1 discourages tokens already in the prompt or output."
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=16, description="Token ids that end generation (not included in output)."
    )
    include_stop_str_in_output: bool = Field(False, description="Keep the stop string that ended the text.")
    # OpenAI's controls over the logits. ortfleet's batcher does them; og.Engine exposes no logits, so a
    # job that asks for one of them fails there with `unsupported_parameter`.
    presence_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted once from the logit of each token already generated."
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Subtracted from the logit of each token once for every time it was generated.",
    )
    logit_bias: dict[TokenId, LogitBias] | None = Field(
        None,
        max_length=MAX_LOGIT_BIAS,
        description="Token id to a bias (-100 to 100) added to its logit before sampling; -100 bans it.",
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Give each generated token's log-probability and those of this many likeliest tokens "
        "at its step (0: the token's own only), in the token events; from the model's distribution before "
        "penalties, bias, masks and temperature.",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Give each prompt token's log-probability (the first's is null) and those of this many "
        "likeliest tokens at its place (0: the token's own only), in one `prompt` event before the first "
        "token; as vLLM's prompt_logprobs. The prompt is then prefilled in whole, never from a cached "
        "prefix.",
    )

    close_early: bool = Field(
        True,
        description="Structured output: where max_tokens would cut the document, the model is steered "
        "onto the shortest ending in time, so the output parses and follows its format (the reply says "
        "`closed_early`); false returns the cut text instead. ortfleet's batcher does it; og.Engine "
        "cannot.",
    )

    @field_validator("min_tokens")
    @classmethod
    def _min_within_max(cls, value: int, info: ValidationInfo) -> int:
        most = info.data.get("max_tokens")
        if most is not None and value > most:
            raise ValueError(f"must not exceed max_tokens ({most})")
        return value


class JobRequest(Sampling):
    """Body of `POST /v1/jobs`: a prompt or chat messages, and sampling parameters."""

    model: str | None = Field(None, description="Served model name; optional when one model is served.")
    prompt: str | None = Field(None, min_length=1, description="Raw text to continue.")
    messages: list[ChatMessage] | None = Field(
        None, min_length=1, description="Chat messages; the worker applies the model's chat template."
    )
    response_format: ResponseFormat | None = Field(
        None, description="Structured output: json_object, json_schema, regex, choice or grammar."
    )
    priority: PriorityClass = Field(
        PriorityClass.interactive,
        description="Priority class: `interactive` (default) or `batch`, which waits while interactive "
        "jobs wait and yields its engine slots to them.",
    )
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CACHE_SALT,
        description=CACHE_SALT,
    )

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class JobSpec(BaseModel):
    """What a worker needs to run a job; travels as JSON in the arq job."""

    id: str
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    sampling: Sampling
    submitted_at: float
    priority: PriorityClass = PriorityClass.interactive
    guidance: Guidance | None = None  # structured output: the grammar the output must follow
    # Who may reuse the KV of this job's prompt, and whose prompts it may reuse: a digest of its API key
    # (or the key's shared group) and its cache_salt (gateway/cache_scope.py). "": jobs queued before
    # scopes existed, which share only among themselves.
    cache_scope: str = ""
    # The LoRA adapter its model's workers run it with (ORTFLEET_LORA_MODULES), when the request named one
    # as its model; None: the model itself.
    adapter: str | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV a worker reused from an earlier request


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # Shown only from engines that report reuse (ortfleet's batcher), as OpenAI's usage has it.
    prompt_tokens_details: PromptTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _details_when_known(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        shown: dict[str, Any] = handler(self)
        if shown.get("prompt_tokens_details") is None:
            shown.pop("prompt_tokens_details", None)
        return shown

    @property
    def cached_tokens(self) -> int | None:
        return None if self.prompt_tokens_details is None else self.prompt_tokens_details.cached_tokens


class Timings(BaseModel):
    queue_wait_s: float | None = Field(None, description="Submission to start on a worker (last attempt).")
    ttft_s: float | None = Field(None, description="Submission to the first generated token.")
    time_per_output_token_s: float | None = Field(
        None, description="Mean seconds between generated tokens after the first."
    )
    total_s: float | None = Field(None, description="Submission to the end of the job.")


class JobLinks(BaseModel):
    self: str
    events: str


class JobView(BaseModel):
    """A job as the API shows it."""

    id: str
    object: Literal["job"] = "job"
    status: JobStatus
    model: str
    created_at: float
    attempts: int = 0
    worker: str | None = None
    priority: PriorityClass = PriorityClass.interactive
    queue_position: int | None = Field(None, description="Jobs ahead of this one while it is queued.")
    queue_eta_s: float | None = Field(
        None,
        description="Seconds until it starts while queued: the estimated tokens ahead of it (prompts and "
        "max_tokens) over the speed the model's workers measured while running jobs.",
    )
    preemptions: int = Field(
        0, description="Times the job was paused for interactive jobs (batch work) or another key's job."
    )
    output: str | None = None
    finish_reason: FinishReason | None = None
    closed_early: bool | None = Field(
        None,
        description="True when max_tokens would have cut the structured output and the engine ended its "
        "document early instead (see the request's close_early); the output is complete. False when "
        "max_tokens cut it and closing was off: the worker found no ending for its format within its "
        "limits (finish_reason length). Null otherwise.",
    )
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None
    error_code: str | None = Field(
        None, description="The error for programs: context_length_exceeded, expired_in_queue, ..."
    )
    engine_batch_peak: int | None = Field(
        None, description="Most requests the engine generated together while running this job."
    )
    worker_deaths: int = Field(
        0,
        description="Workers that died running this job. The first makes it suspect: its later attempts "
        "run alone on their worker, in quarantine.",
    )
    quarantine_deaths: int = Field(
        0,
        description="Worker deaths while the job ran in quarantine; at ORTFLEET_MAX_ATTEMPTS, poison.",
    )
    resumed_from: int | None = Field(
        None, description="Tokens already streamed when the last attempt resumed the job (none: not resumed)."
    )
    resume_exact: bool | None = Field(
        None, description="Whether the resumed attempt's replay computed every streamed token again exactly."
    )
    links: JobLinks


class EventType(str, Enum):
    status = "status"
    prompt = "prompt"  # the prompt's tokens and their log-probabilities, when the job asked for them
    token = "token"
    done = "done"
    error = "error"
