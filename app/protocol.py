"""OpenAI-compatible request models (HTTP and Python handle API) and the ingress <-> replica messages."""
from __future__ import annotations

import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from affinity_serve.app.errors import APIError, pydantic_error

from affinity_serve.engine.sampling_params import SamplingParams
from affinity_serve.engine.types import EngineRequest, RequestDelta


#: The engine's integer ranges: token counts and ids are 32-bit, seeds 64-bit. A larger number is a 400 here,
#: not an overflow somewhere further in (issue 33).
INT32_MAX = 2**31 - 1
TokenCount = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    #: vLLM's: with include_usage, every chunk carries the usage so far too (not only the last one)
    continuous_usage_stats: bool = False

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        reject_unknown_fields(cls, data, "stream_options.")
        return data


def reject_unknown_fields(model: type[BaseModel], data: Any, where: str = "") -> None:
    """A 400 naming every field of `data` that `model` does not implement: a field the server would drop
    would change nothing the client asked for (e.g. `tools` answered with plain text), so it is refused."""
    if not isinstance(data, dict):
        return
    known = {f.alias or name for name, f in model.model_fields.items()}
    unknown = sorted(str(k) for k in data if k not in known)
    if unknown:
        names = ", ".join(f"'{where}{k}'" for k in unknown)
        raise APIError(f"unsupported field(s) {names}: this server does not implement them (remove them, or see "
                       "docs/api.md for the supported fields)", 400, "invalid_request_error",
                       where + unknown[0], "unsupported_field")


class _Strict(BaseModel):
    """A nested request object: unknown keys are a 400 naming them (prefixed with `_where`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    _where: ClassVar[str] = ""

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        reject_unknown_fields(cls, data, cls._where)
        return data


class JSONSchemaFormat(_Strict):
    """`response_format.json_schema`: the output is JSON valid against `schema`."""

    _where: ClassVar[str] = "response_format.json_schema."
    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field({}, alias="schema")
    #: OpenAI's strict mode; the grammar always enforces the schema, so both values are honoured
    strict: bool | None = None


class ResponseFormat(_Strict):
    _where: ClassVar[str] = "response_format."
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsParams(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of these."""

    _where: ClassVar[str] = "structured_outputs."
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    #: vLLM's: the JSON is always compact (no free whitespace), so either value is met
    disable_any_whitespace: bool | None = None


class FunctionDefinition(_Strict):
    _where: ClassVar[str] = "tools.function."
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    _where: ClassVar[str] = "tools."
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    _where: ClassVar[str] = "tool_choice.function."
    name: str


class NamedToolChoice(_Strict):
    _where: ClassVar[str] = "tool_choice."
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


def _leaf_types(annotation: Any) -> set:
    """The plain types an annotation admits (through Optional, unions and Annotated)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, typing.Annotated):
        out = set()
        for a in (args[:1] if typing.get_origin(annotation) is typing.Annotated else args):
            out |= _leaf_types(a)
        return out
    return {annotation}


@functools.cache
def _number_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields that take a number and not a boolean: JSON `true` there is a 400, not 1."""
    return frozenset(name for name, f in model.model_fields.items()
                     if _leaf_types(f.annotation) & {int, float} and bool not in _leaf_types(f.annotation))


#: fields holding token ids in lists (a completion's prompt may nest them one level)
_TOKEN_LIST_FIELDS = ("prompt", "stop_token_ids")


def _holds_a_boolean(value: Any) -> bool:
    return isinstance(value, list) and any(isinstance(v, bool) or _holds_a_boolean(v) for v in value)


class _OpenAIRequest(BaseModel):
    # Unknown fields are a 400 naming them (reject_unknown_fields), never dropped; known ones are
    # type-checked -> 400. NaN and infinities are refused everywhere (the HTTP body reader already refuses
    # JSON's NaN/Infinity literals).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def __init__(self, **data: Any) -> None:
        """Built in a caller's code (the handle API's typed requests), a bad value is the APIError (400, naming
        the field) that the same value gets over HTTP, not pydantic's ValidationError."""
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise pydantic_error(e) from None

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        reject_unknown_fields(cls, data)
        if isinstance(data, dict):
            # OpenAI's schema makes the optional fields nullable: null means "the default", as in vLLM
            data = {k: v for k, v in data.items() if v is not None}
            for k in _number_fields(cls):
                if isinstance(data.get(k), bool):
                    raise APIError(f"invalid value for '{k}': expected a number, got {str(data[k]).lower()}", 400,
                                   "invalid_request_error", k, "invalid_value")
            for k in _TOKEN_LIST_FIELDS:
                if _holds_a_boolean(data.get(k)):
                    raise APIError(f"invalid value for '{k}': token ids are integers, not booleans", 400,
                                   "invalid_request_error", k, "invalid_value")
            top_k = data.get("top_k")
            if type(top_k) is int and top_k in (0, -1):      # vLLM's "no top-k"
                del data["top_k"]
            elif type(top_k) is int and top_k < -1:
                raise APIError(f"top_k must be >= 1, or -1 or 0 for no top-k; got {top_k}", 400,
                               "invalid_request_error", "top_k", "invalid_value")
        return data

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)
    # extensions (vLLM-style)
    #: -1 or 0 (vLLM's "disabled") mean no top-k, like leaving it out
    top_k: int | None = Field(None, ge=1, le=INT32_MAX)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    min_tokens: TokenCount = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = Field(0, ge=-2**31, le=INT32_MAX)
    cache_salt: str | None = Field(None, min_length=1)
    request_id: str | None = None
    #: vLLM's extension: each choice's generated `token_ids`, and its prompt's `prompt_token_ids`
    return_token_ids: bool = False
    #: OpenAI's end-user identifier: accepted (clients send it) and used for nothing, as in vLLM
    user: str | None = None
    #: OpenAI's "keep this completion on the platform": nothing is stored here, so both values answer alike
    store: bool | None = None
    #: structured output (docs/structured-outputs.md): OpenAI's response_format, and vLLM's extensions
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    #: vLLM's older per-request backend choice: xgrammar is the one backend here
    guided_decoding_backend: Literal["xgrammar", "auto"] | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None, n: int,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; `n` sequences per prompt (more than `self.n` for best_of)."""
        bias = None
        if self.logit_bias:
            from affinity_serve.engine.errors import InvalidRequestError
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias") from None
            if any(not 0 <= k <= INT32_MAX for k in bias):
                raise InvalidRequestError("logit_bias keys must be token ids", param="logit_bias")
        if self.min_tokens > max_tokens:
            from affinity_serve.engine.errors import InvalidRequestError
            sent = getattr(self, "max_completion_tokens", None) or self.max_tokens
            limit = f"max_tokens ({max_tokens})" if sent is not None else f"max_tokens (not sent: {max_tokens})"
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be at most {limit}",
                                      param="min_tokens", code="invalid_value")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, logit_bias=bias,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output)


class CompletionRequest(_OpenAIRequest):
    """POST /v1/completions; also the typed argument of `handle.completions.remote(...)`."""

    prompt: str | list[int] | list[str] | list[list[int]]
    #: 0 only with echo: the prompt alone, scored (as OpenAI's legacy API and vLLM allow)
    max_tokens: int | None = Field(None, ge=0, le=INT32_MAX)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    #: vLLM's extension: each choice's `prompt_logprobs`, the prompt tokens' logprobs with top-k each
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    #: generate best_of sequences per prompt, return the n with the highest cumulative logprob
    best_of: int | None = Field(None, ge=1, le=20)


class ContentPart(BaseModel):
    """One part of a message's content: text only (an image or audio part is a 400, never dropped)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"] = "text"
    text: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type", "text") != "text":
            raise APIError(f"content parts of type {str(data.get('type'))[:40]!r} are not supported: this server "
                           "serves text models (send text parts)", 400, "invalid_request_error",
                           "messages.content.type", "unsupported_field")
        reject_unknown_fields(cls, data, "messages.content.")
        return data


#: response-message fields a client may send back in the history, accepted while empty
_EMPTY_ASSISTANT_FIELDS = frozenset({"refusal", "annotations", "audio", "function_call"})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    #: the participant's name: passed to the chat template with the message (templates may render it)
    name: str | None = None
    #: an assistant's earlier tool calls and a tool result's call id, passed to the chat template as given
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_fields_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(k in data for k in _EMPTY_ASSISTANT_FIELDS):
            # an assistant message echoed back from a response (the openai client sends OpenAI's own fields
            # with their empty values): empty, they say nothing; with a value they are refused below
            data = {k: v for k, v in data.items() if not (k in _EMPTY_ASSISTANT_FIELDS and v in (None, [], {}, ""))}
        reject_unknown_fields(cls, data, "messages.")
        return data


class ChatCompletionRequest(_OpenAIRequest):
    """POST /v1/chat/completions; also the typed argument of `handle.chat.remote(...)`."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    #: function tools; with tool_choice "required" or a named function the output is a grammar-constrained
    #: call (app/tool_calls.py); "auto" needs a model-specific call format and is refused (a 400)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    #: vLLM's extensions to the chat template: extra template variables (e.g. Qwen3's `enable_thinking`),
    #: the assistant turn's opening (default on), and leaving the last (assistant) message open to continue it
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _generation_prompt_default(self) -> "ChatCompletionRequest":
        if self.add_generation_prompt is None:
            self.add_generation_prompt = not self.continue_final_message
        return self

    def rendered_messages(self) -> list[dict[str, Any]]:
        out = []
        for m in self.messages:
            content = m.content
            if isinstance(content, list):
                content = "".join(p.text or "" for p in content)
            msg: dict[str, Any] = {"role": m.role, "content": content or ""}
            for key in ("name", "tool_calls", "tool_call_id"):
                if getattr(m, key) is not None:
                    msg[key] = getattr(m, key)
            out.append(msg)
        return out


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's): a `prompt` as the completions API tokenizes it, or `messages` (and `tools`)
    rendered by the chat template as the chat API does."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    add_generation_prompt: bool | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", 400, "invalid_request_error",
                           "prompt" if self.prompt is None else "messages", "invalid_value")
        if self.tools and self.messages is None:
            raise APIError("'tools' go with 'messages'", 400, "invalid_request_error", "tools", "invalid_value")
        return self

    def chat_request(self) -> "ChatCompletionRequest":
        """The chat request whose prompt this is (for rendering with the chat API's own code)."""
        return ChatCompletionRequest(model=self.model, messages=self.messages, tools=self.tools,
                                     chat_template_kwargs=self.chat_template_kwargs,
                                     add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message)


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's): token ids back to text, special tokens kept."""

    model: str | None = None
    tokens: list[TokenId] = Field(..., max_length=1_000_000)


# ---------------------------------------------------------------- ingress <-> replica
class LocalOnly:
    """A slot whose value stays in this process: it pickles as empty (what the router leaves on a request for
    the ingress that sent it must not travel to the replica)."""

    __slots__ = ("value",)

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def __reduce__(self) -> tuple:
        return (LocalOnly, ())


@dataclass(slots=True)
class GenerateRequest(EngineRequest):
    """What the ingress sends a replica: the EngineRequest itself (built once, per prompt; the replica's
    engine takes it as it is), plus what the app adds for logs, spans and routing.

    `req_id` is unique per call (the engine's key); `request_id` is the caller's id (x-request-id), which
    clients may reuse: it only labels logs and spans.
    """

    request_id: str | None = None
    #: set by the router when it places the request: the (at most two) replicas its index predicts hold most
    #: of the prompt, with their cached tokens, best first (Decision.most_cached); the replica reports the part
    #: of its prefill that recomputes what another of them holds apart (the autoscaler's
    #: `refill_tokens_per_s`). None: no router prediction (load-only routing, a fallback).
    cached_on: list[tuple[str, int]] | None = None
    #: set by the router in this process when it places the request (a re-route replaces it): its Decision,
    #: read by the ingress at the first token for the request's routing span and metrics; not sent on
    routing: LocalOnly = field(default_factory=LocalOnly, compare=False, repr=False)
    #: P/D (app/disagg.py): the prefill replica the ingress's router chose for this request (prefix affinity
    #: on the prefill pool), which the decode replica's call to the prefill pool goes to first; the decode
    #: replica was then chosen near it (same node). None: the decode replica's own prefill router decides.
    prefill_replica: str | None = None
    #: P/D: the ingress's router found the prefill pool predicted too slow for this request
    #: (disaggregation.local_prefill_slack_s): the decode replica prefills it itself, without calling the pool
    local_prefill: bool = False


@dataclass(slots=True)
class ReplicaChunk(RequestDelta):
    """One step's output for one sequence, as streamed back by a replica: the engine's RequestDelta plus
    what the replica adds."""

    replica_id: str = ""
    #: set on a sequence's last chunk: monotonic timings measured in the replica (seconds)
    timings: dict[str, float] | None = None
    #: set on a sequence's last chunk: its engine span's trace id
    trace_id: str | None = None
    #: set on a sequence's last chunk when the replica has a KV connector: (tier, its cumulative counters)
    kv_tier: tuple[str, dict[str, int]] | None = None

    @classmethod
    def of(cls, d: RequestDelta, replica_id: str) -> ReplicaChunk:
        """The engine's delta `d` with this replica's id (its other fields are set on a sequence's last chunk)."""
        return cls(d.req_id, d.index, d.text, d.token_ids, d.finish_reason, d.stop_reason, d.logprobs,
                   d.prompt_logprobs, d.num_prompt_tokens, d.num_cached_tokens, d.first_scheduled_time,
                   d.kv_transfer, d.kv_wait_s, replica_id)
