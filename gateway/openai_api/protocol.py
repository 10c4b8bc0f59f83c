"""OpenAI's request and response shapes, as far as ortfleet serves them.

Unknown fields are ignored, as OpenAI clients expect. Fields OpenAI defines that ortfleet cannot
honour are declared loosely typed, so a request that sets one to anything but its neutral value is
answered with a 400 naming it (`unsupported_parameters`), never silently dropped: each such field is
marked `Neutral`, with the values that change nothing here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    model_serializer,
)

from common.wire import CACHE_SALT, MAX_TOP_LOGPROBS, LogitBias, PriorityClass, Usage

MAX_CHOICES = 128
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on a text completion's logprobs


@dataclass(frozen=True)
class Neutral:
    """Marks a field OpenAI defines that ortfleet cannot honour: a request may set it only to a value
    `accepts` allows."""

    accepts: Callable[[Any], bool]


def neutral(*values: Any) -> Neutral:
    """Accepts null and `values`."""
    return Neutral(lambda value: value is None or value in values)


def _empty(value: Any) -> bool:
    return value is None or value is False or value == {} or value == []


def _probability(value: float | None) -> float | None:
    if value is not None and not 0.0 <= value <= 1.0:  # NaN too
        raise ValueError("must be a number from 0 to 1")
    return value


Unset = Annotated[Any, neutral()]
ServiceTier = Annotated[Any, neutral("auto", "default")]  # no other tier to run on


class OpenAIRequest(BaseModel):
    """A request body of OpenAI's."""

    model_config = ConfigDict(extra="ignore")

    def unsupported_parameters(self) -> list[str]:
        """The parameters set to something ortfleet cannot do, in declaration order."""
        return [
            name
            for name, field in type(self).model_fields.items()
            if any(isinstance(m, Neutral) and not m.accepts(getattr(self, name)) for m in field.metadata)
        ]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = Field(
        None, description="vLLM's: usage so far in every chunk."
    )


class GenerationParams(OpenAIRequest):
    """What chat and text completions share."""

    model: str | None = Field(None, description="Served model name; optional when one model is served.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="Default 1; 0 is greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling bound; default 1.")
    top_k: int | None = Field(None, ge=0, le=1000, description="vLLM's extension; 0 is off.")
    stop: str | list[str] | None = Field(None, description="Up to 16 strings that end generation.")
    seed: int | None = Field(
        None,
        ge=-(2**63),
        le=2**63 - 1,
        description="Makes sampling reproducible: any 64-bit integer, as OpenAI's. Choice k samples with "
        "seed + k, and the engine with that modulo 2^31 (ORT-GenAI takes 31-bit seeds), so seeds 2^31 "
        "apart sample alike.",
    )
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, description="Choices to generate (default 1).")
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = Field(None, description="Read only when `stream` is true.")
    user: str | None = Field(None, description="Accepted and ignored.")
    # vLLM's sampling extensions (validated again as the job's sampling).
    ignore_eos: StrictBool | None = Field(None, description="Generate exactly max_tokens.")
    min_tokens: int | None = Field(None, ge=0, description="Fewest tokens to generate.")
    repetition_penalty: float | None = Field(None, description="Above 1 discourages repeats.")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end generation.")
    include_stop_str_in_output: StrictBool | None = Field(
        None, description="Keep the stop string in the text."
    )
    # Structured output (see structured.py): at most one of these.
    close_early: StrictBool | None = Field(
        None,
        description="ortfleet's extension, for structured output: true (default) ends the document early "
        "where max_tokens would cut it (the choice says `closed_early`); false returns the cut text.",
    )
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    priority: PriorityClass | None = Field(
        None, description="ortfleet's extension: the job's priority class, interactive (default) or batch."
    )
    cache_salt: str | None = Field(None, description=CACHE_SALT)
    # OpenAI's controls over the logits (validated again as the job's sampling; honoured by workers that
    # run ortfleet's batcher, see common/wire.py).
    presence_penalty: float | None = Field(None, description="-2 to 2; lowers tokens already generated.")
    frequency_penalty: float | None = Field(
        None, description="-2 to 2; lowers tokens by how often they were generated."
    )
    logit_bias: dict[str, LogitBias] | None = Field(
        None, description="Token id (as a string) to a bias from -100 to 100 added to its logit."
    )
    min_p: Annotated[float | None, AfterValidator(_probability), neutral(0)] = Field(
        None,
        json_schema_extra={"minimum": 0, "maximum": 1},
        description="vLLM's: 0 to 1; only 0 (off) is served, ortfleet's sampler has no min-p.",
    )

    def job_logprobs(self) -> int | None:
        """How many likeliest tokens' log-probabilities the job gives with each token (None: none)."""
        return None

    def job_prompt_logprobs(self) -> int | None:
        """The same for each prompt token (None: none)."""
        return None

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return self.streaming and self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        options = self.stream_options
        return self.streaming and options is not None and bool(options.continuous_usage_stats)

    def generated_limit(self) -> int | None:
        return self.max_tokens

    def limit_name(self) -> str:
        """The field the client used for the limit on generated tokens."""
        return "max_tokens"


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: Any = None  # an assistant's calls: [{"id", "type": "function", "function": {...}}]
    function_call: Any = None  # the legacy form of one call
    tool_call_id: str | None = None


class ChatCompletionRequest(GenerationParams):
    """Body of `POST /v1/chat/completions`."""

    messages: list[ChatMessageIn] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Preferred over `max_tokens`.")
    logprobs: StrictBool | None = Field(None, description="Give each output token's log-probability.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="With `logprobs`: the likeliest tokens at each step."
    )
    # Tool calling (tools.py): checked there, so a malformed one is a 400 naming its field.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = Field(
        None, description="Whether the answer may hold several calls."
    )
    functions: Any = None
    function_call: Any = None
    audio: Annotated[Any, Neutral(_empty)] = None
    modalities: Annotated[Any, neutral(["text"])] = None
    # OpenAI's fields for its own models and platform: accepted at the values that change nothing here.
    service_tier: ServiceTier = None
    reasoning_effort: Annotated[Any, neutral("none")] = None  # no reasoning model
    verbosity: Annotated[Any, neutral("medium")] = None  # the default: the model's own length
    web_search_options: Unset = None  # no search
    moderation: Unset = None  # no moderation

    def generated_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def limit_name(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def job_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationParams):
    """Body of `POST /v1/completions`."""

    prompt: str | list[Any] = Field(..., description="A string, or a list of strings (one choice each).")
    max_tokens: int | None = Field(
        None, ge=1, description="Most tokens to generate (default 16, as OpenAI's)."
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_COMPLETION_LOGPROBS,
        description="Give each output token's log-probability and those of this many likeliest tokens.",
    )
    echo: StrictBool | None = Field(
        False, description="Answer with the prompt before the completion (and its logprobs, when asked)."
    )
    suffix: Annotated[Any, neutral("")] = None
    best_of: Any = None  # accepted only as the number of choices

    def generated_limit(self) -> int | None:
        return self.max_tokens or 16

    def job_logprobs(self) -> int | None:
        return self.logprobs

    def job_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def unsupported_parameters(self) -> list[str]:
        one_each = self.best_of is None or self.best_of == self.choices_per_prompt
        return [*super().unsupported_parameters(), *([] if one_each else ["best_of"])]


# Responses -----------------------------------------------------------------------------------------

OpenAIFinishReason = Literal["stop", "length", "tool_calls", "function_call"]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None  # OpenAI's field (required, null): ortfleet's models never refuse by schema
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None

    @model_serializer(mode="wrap")
    def _calls_when_made(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        shown: dict[str, Any] = handler(self)
        for key in ("tool_calls", "function_call"):
            if shown.get(key) is None:
                shown.pop(key, None)
        return shown


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _only_what_is_set(self) -> dict[str, str]:
        return {
            key: value
            for key, value in (("name", self.name), ("arguments", self.arguments))
            if value is not None
        }


class ToolCallDelta(BaseModel):
    """A streamed piece of a call: its first carries `id`, `type` and the name, the others arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer
    def _only_what_is_set(self) -> dict[str, Any]:
        shown: dict[str, Any] = {"index": self.index, "id": self.id, "type": self.type}
        shown = {key: value for key, value in shown.items() if value is not None}
        return {**shown, "function": self.function.model_dump()}


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class OpenAIObject(BaseModel):
    """What OpenAI's completions and their chunks begin with (`object` names the kind)."""

    id: str
    object: str
    created: int
    model: str


CLOSED_EARLY = (
    "ortfleet's: true when max_tokens would have cut the structured output (a JSON schema, a JSON object, "
    "a tool call's arguments) and the engine ended the document early instead, so that it parses and "
    "follows its format; finish_reason is then `stop` (or `tool_calls`). False when max_tokens cut it "
    "and closing was off: the worker found no ending for its format within its limits (finish_reason "
    "`length`). Absent otherwise."
)


class ClosingChoice(BaseModel):
    """A choice that may carry ortfleet's `closed_early`, shown only when set."""

    closed_early: bool | None = Field(None, description=CLOSED_EARLY)

    @model_serializer(mode="wrap")
    def _closed_early_when_set(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        shown: dict[str, Any] = handler(self)
        if shown.get("closed_early") is None:
            shown.pop("closed_early", None)
        return shown


class ChatChoice(ClosingChoice):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: OpenAIFinishReason


class ChatCompletion(OpenAIObject):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    function_call: FunctionCallDelta | None = None

    @model_serializer
    def _only_what_is_set(self) -> dict[str, Any]:
        shown: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls is not None:
            shown["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.function_call is not None:
            shown["function_call"] = self.function_call.model_dump()
        return {key: value for key, value in shown.items() if value is not None}


class ChatChunkChoice(ClosingChoice):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: OpenAIFinishReason | None = None


class ChatCompletionChunk(OpenAIObject):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # null for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(ClosingChoice):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: OpenAIFinishReason | None


class Completion(OpenAIObject):
    """A text completion, and also each chunk of a streamed one (OpenAI uses one shape for both)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None

    @model_serializer(mode="wrap")
    def _usage_when_known(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        shown: dict[str, Any] = handler(self)
        if shown.get("usage") is None:
            shown.pop("usage", None)  # OpenAI's completion usage is an object or absent, never null
        return shown
