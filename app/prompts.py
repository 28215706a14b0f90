"""From an OpenAI request to what the replicas run: token-id prompts, SamplingParams, checked limits.

The limits are the engine's own (`EngineLimits`, published by a replica) and are checked with the
engine's own function, so nothing here predicts what the engine will accept.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from affinity_serve.app.errors import APIError
from affinity_serve.app.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from affinity_serve.app.tool_calls import ToolCallMode, tool_call_grammar
from affinity_serve.engine import EngineLimits, apply_chat_template, token_ids_only_error
from affinity_serve.engine.errors import ContextLengthExceededError, InvalidRequestError
from affinity_serve.engine.hashing import BlockHash, hash_block_chain
from affinity_serve.engine.sampling_params import SamplingParams
from affinity_serve.engine.structured_output import StructuredOutputSpec


class RequestKind(str, Enum):
    COMPLETION = "completion"
    CHAT = "chat"


@dataclass(slots=True)
class PreparedRequest:
    """A validated request: one token-id prompt per entry, and how to sample and answer it."""

    kind: RequestKind
    request_id: str                   # the client-visible id (response `id`, logs, spans); not the engine key
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str | None]    # each completion prompt's text (with echo: token-id prompts decoded)
    params: SamplingParams            # params.n sequences per prompt: best_of when given, else n
    num_choices: int                  # choices returned per prompt (n)
    logprobs: int | None              # what the client asked for; None: no logprobs in the response
    prompt_logprobs: int | None       # vLLM's `prompt_logprobs` field (completions): top-k per prompt token
    echo: bool                        # completions: each choice starts with its prompt (and its logprobs)
    echo_only: bool                   # max_tokens 0 with echo: the prompt alone; the one token run is dropped
    stream_usage: bool
    priority: int
    cache_salt: str | None
    return_token_ids: bool = False    # vLLM's extension: prompt and generated token ids in the response
    #: each prompt's full-block hashes, as the engine computes them (None: the replica's block size is unknown)
    block_hashes: list[list[BlockHash]] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    #: chat with tools and tool_choice "required" or a named function: how the output reads back as tool calls
    tool_mode: ToolCallMode | None = None
    #: stream_options.continuous_usage_stats (with include_usage): every chunk carries the usage so far
    continuous_usage: bool = False
    #: the limits every prompt was checked against (`EngineLimits.check_fits_context`): an engine with these
    #: limits does not check them again (EngineRequest.checked_limits)
    checked_limits: EngineLimits | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def prepare_request(kind: RequestKind, req: CompletionRequest | ChatCompletionRequest, request_id: str, *,
                    model_name: str, limits: EngineLimits, tokenizer: Any | None,
                    max_prompts: int | None = None, max_token_chars: int | None = None,
                    tool_call_parser: str = "auto") -> PreparedRequest:
    """Raise APIError or InvalidRequestError (-> 400/404) for anything the engine would refuse.

    `tokenizer` is None in token-ids-only mode: only token-id prompts are accepted then. `max_prompts`
    (serve.max_prompts_per_request) bounds a completion's prompts, and `max_token_chars` (the tokenizer's
    longest token, max_token_chars()) a text's length, both checked before anything is tokenized.
    `tool_call_parser` (serve.tool_call_parser) reads tool_choice "auto" calls back (resolve_tool_parser).
    """
    if req.stream_options is not None and not req.stream:      # (the handle's *_stream methods set stream)
        raise APIError("stream_options is only allowed with stream: true (remove it, or set stream)", 400,
                       "invalid_request_error", "stream_options", "invalid_value")
    if req.model is not None and req.model != model_name:
        raise APIError(f"the model '{req.model}' does not exist; this server serves '{model_name}'",
                       404, "invalid_request_error", "model", "model_not_found")
    if max_token_chars is not None:
        check_text_fits_context(kind, req, limits, max_token_chars)
    if kind is RequestKind.CHAT:
        prompts, texts = [chat_prompt_ids(req, tokenizer)], [None]
        logprobs = _chat_logprobs(req)
        max_tokens = req.max_completion_tokens or req.max_tokens
    else:
        _check_num_prompts(req.prompt, max_prompts)
        prompts, texts = completion_prompt_ids(req.prompt, tokenizer)
        logprobs = req.logprobs
        max_tokens = req.max_tokens
    echo = kind is RequestKind.COMPLETION and req.echo
    max_tokens = _resolve_max_tokens(kind, max_tokens, echo, limits, prompts)
    # max_tokens 0 runs one token (the engine's minimum; prompt logprobs come with it), which is then dropped
    engine_max_tokens = max(max_tokens, 1)
    _check_limits(kind, limits, prompts, engine_max_tokens)
    if tokenizer is None and req.stop:
        raise token_ids_only_error("stop")
    num_seqs = _num_seqs(req)
    # ranking best_of sequences needs each sampled token's logprob, even when the client asked for none
    engine_logprobs = logprobs if logprobs is not None or num_seqs == req.n else 0
    params = req.sampling_params(engine_max_tokens, engine_logprobs, num_seqs, _engine_prompt_logprobs(req))
    spec, tool_mode = structured_output_spec(req, tokenizer, tool_call_parser)
    if spec is not None:
        if tokenizer is None:
            raise token_ids_only_error(spec.param)
        if params.min_tokens:
            raise APIError(f"min_tokens cannot be combined with {spec.param}: a finished grammar allows only the "
                           "end of the sequence", 400, "invalid_request_error", "min_tokens", "invalid_value")
        spec.check()                   # an invalid schema is a 400 here, before any replica sees it
        params = params.copy_with(structured_output=spec)
    if echo:
        texts = [_echo_text(ids, tokenizer) if t is None else t for ids, t in zip(prompts, texts)]
    return PreparedRequest(kind, req.request_id or request_id, model_name, prompts, texts, params, req.n, logprobs,
                           getattr(req, "prompt_logprobs", None), echo, max_tokens == 0,
                           bool(req.stream_options and req.stream_options.include_usage), req.priority,
                           req.cache_salt, req.return_token_ids,
                           prompt_block_hashes(prompts, limits.block_size, req.cache_salt), tool_mode=tool_mode,
                           continuous_usage=bool(req.stream_options and req.stream_options.include_usage
                                                 and req.stream_options.continuous_usage_stats),
                           checked_limits=limits)


def structured_output_spec(req: CompletionRequest | ChatCompletionRequest, tokenizer: Any | None = None,
                           tool_call_parser: str = "auto") -> tuple[StructuredOutputSpec | None, ToolCallMode | None]:
    """The grammar the request asks for (response_format, vLLM's structured_outputs / guided_*, or a chat's
    tools) and, for tools, how its output reads back; at most one of them may be given (else a 400)."""
    tool_spec, tool_mode = (tool_call_grammar(req, tokenizer, tool_call_parser)
                            if isinstance(req, ChatCompletionRequest) else (None, None))
    specs = {"tools": tool_spec} if tool_spec is not None else {}
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        specs["response_format"] = StructuredOutputSpec(json_object=True, param="response_format")
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError("response_format of type json_schema needs json_schema: {name, schema} (without "
                           "schema: any JSON)", 400, "invalid_request_error", "response_format.json_schema",
                           "invalid_value")
        specs["response_format"] = StructuredOutputSpec.from_schema(rf.json_schema.json_schema,
                                                                    "response_format.json_schema.schema")
    so = req.structured_outputs
    if so is not None:
        specs["structured_outputs"] = StructuredOutputSpec(
            json=None if so.json_ is None else StructuredOutputSpec.from_schema(so.json_).json,
            json_object=bool(so.json_object), regex=so.regex, grammar=so.grammar,
            choice=None if so.choice is None else tuple(so.choice), param="structured_outputs")
    guided = {"guided_json": req.guided_json, "guided_regex": req.guided_regex,
              "guided_choice": req.guided_choice, "guided_grammar": req.guided_grammar}
    for name, value in guided.items():
        if value is None:
            continue
        if name == "guided_json":
            specs[name] = StructuredOutputSpec.from_schema(value, name)
        elif name == "guided_choice":
            specs[name] = StructuredOutputSpec(choice=tuple(value), param=name)
        else:
            specs[name] = StructuredOutputSpec(**{name.removeprefix("guided_"): value}, param=name)
    if len(specs) > 1:
        raise APIError(f"give at most one of {', '.join(specs)}: each constrains the whole output", 400,
                       "invalid_request_error", list(specs)[1], "invalid_value")
    return next(iter(specs.values()), None), tool_mode


def prompt_block_hashes(prompts: list[list[int]], block_size: int | None,
                        cache_salt: str | None) -> list[list[BlockHash]] | None:
    """The engine's block hashes of each prompt, computed once here: the router matches them against the
    replicas' caches and the replica's engine uses them instead of hashing the prompt again."""
    if block_size is None:
        return None
    return [hash_block_chain(ids, block_size, cache_salt) for ids in prompts]


def _resolve_max_tokens(kind: RequestKind, max_tokens: int | None, echo: bool, limits: EngineLimits,
                        prompts: list[list[int]]) -> int:
    """The client's max_tokens, or OpenAI's default: 16 for completions, the rest of the context for chat.
    0 is allowed only with echo (the prompt alone, scored), as in OpenAI's legacy API and vLLM."""
    if max_tokens is None:
        longest = max(len(p) for p in prompts)
        return 16 if kind is RequestKind.COMPLETION else max(1, limits.max_model_len - longest)
    if max_tokens == 0 and not echo:
        raise APIError("max_tokens may be 0 only with echo: true (then the prompt alone is returned)", 400,
                       "invalid_request_error", "max_tokens", "invalid_value")
    return max_tokens


#: Normalizers may compose characters (NFC turns a Hangul jamo triple into one syllable) before tokens are cut:
#: the character bound allows this many characters of text per character of a token.
NORMALIZATION_SLACK = 4


def max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token can stand for: its vocabulary's longest entry (a byte-level
    entry has one character per byte, a SentencePiece byte-fallback entry reads `<0x0A>`: both at least as
    long as the text they decode to; added tokens are matched in text by their content)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1


def text_chars(kind: RequestKind, req: CompletionRequest | ChatCompletionRequest) -> int:
    """Characters of text the request would tokenize (a completion's prompt strings, chat message contents)."""
    if kind is RequestKind.CHAT:
        total = 0
        for m in req.messages:
            content = m.content
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                total += sum(len(p.text or "") for p in content)
        return total
    prompt = req.prompt
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return max((len(p) for p in prompt if isinstance(p, str)), default=0)   # each prompt is its own request
    return 0


def check_text_fits_context(kind: RequestKind, req: CompletionRequest | ChatCompletionRequest,
                            limits: EngineLimits, max_token_chars: int) -> None:
    """A 400 (`context_length_exceeded`), before tokenizing, for text longer than the context could hold even
    if every token were the vocabulary's longest: tokenizing a megabyte prompt only to refuse it costs
    seconds of the prepare thread and keeps its memory in the allocator (issue 33.12)."""
    bound = limits.max_model_len * max_token_chars * NORMALIZATION_SLACK
    n = text_chars(kind, req)
    if n > bound:
        raise ContextLengthExceededError(
            f"the prompt has {n} characters, more than this model's maximum context length of "
            f"{limits.max_model_len} tokens can hold (at most {bound} characters); shorten the prompt",
            param="messages" if kind is RequestKind.CHAT else "prompt")


def _check_num_prompts(prompt: Any, max_prompts: int | None) -> None:
    """A batch (a list of strings or of token-id lists) of more than `max_prompts` prompts is a 400."""
    if max_prompts is None or not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):
        return
    if len(prompt) > max_prompts:
        raise APIError(f"this request has {len(prompt)} prompts; at most {max_prompts} are allowed per request "
                       "(serve.max_prompts_per_request): split the batch", 400, "invalid_request_error", "prompt",
                       "too_many_prompts")


def completion_prompt_ids(prompt: Any, tokenizer: Any | None) -> tuple[list[list[int]], list[str | None]]:
    """A string, a list of strings, token ids, or a list of token-id lists -> (ids per prompt, texts)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        if tokenizer is None:
            raise token_ids_only_error("prompt")
        return [tokenizer.encode(t) for t in texts], list(texts)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return prompt, [None] * len(prompt)       # the parsed body's own lists: the engine takes them as they are
    if isinstance(prompt, list) and all(isinstance(p, int) for p in prompt):
        return [prompt], [None]
    raise APIError("prompt must be a string, a list of strings, or token ids", 400, "invalid_request_error",
                   "prompt", "invalid_value")


def _echo_text(ids: list[int], tokenizer: Any | None) -> str:
    """The echo of a token-id prompt: its decoded text, special tokens kept (as vLLM); "" without a tokenizer."""
    if tokenizer is None:
        return ""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _engine_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Top-k the engine computes per prompt token: for `prompt_logprobs`, and for `logprobs` with echo (the
    echoed prompt's tokens are scored too). Such requests skip the prefix-cache lookup (engine docs)."""
    if not isinstance(req, CompletionRequest):
        return None
    if req.prompt_logprobs is not None and req.stream:
        raise APIError("`prompt_logprobs` are not available when `stream=True`", 400, "invalid_request_error",
                       "prompt_logprobs", "invalid_value")
    ks = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None]
    return max(ks) if ks else None


def chat_prompt_ids(req: ChatCompletionRequest, tokenizer: Any | None, add_generation_prompt: bool | None = None
                    ) -> list[int]:
    """The chat request's prompt as the model's template renders it; `add_generation_prompt` None: the
    request's own (True unless it continues its final message)."""
    if tokenizer is None:
        raise token_ids_only_error("messages")
    if add_generation_prompt is None:
        add_generation_prompt = req.add_generation_prompt
    # the tool definitions go through the model's own template (`tools=`), as transformers renders them
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    return apply_chat_template(tokenizer, req.rendered_messages(), add_generation_prompt,
                               continue_final_message=req.continue_final_message,
                               template_kwargs=req.chat_template_kwargs, tools=tools)


def _chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs and not req.logprobs:
        raise APIError("top_logprobs requires logprobs: true", 400, "invalid_request_error", "top_logprobs",
                       "invalid_value")
    return (req.top_logprobs or 0) if req.logprobs else None


def _num_seqs(req: CompletionRequest | ChatCompletionRequest) -> int:
    """Sequences generated per prompt: best_of (completions only, as in OpenAI's API) or n."""
    best_of = getattr(req, "best_of", None)
    if best_of is None:
        return req.n
    if best_of < req.n:
        raise APIError(f"best_of ({best_of}) must be greater than or equal to n ({req.n})", 400,
                       "invalid_request_error", "best_of", "invalid_value")
    if req.stream and best_of > 1:
        raise APIError("best_of > 1 cannot be streamed: only the best sequences are returned, once all finished",
                       400, "invalid_request_error", "best_of", "invalid_value")
    return best_of


def _check_limits(kind: RequestKind, limits: EngineLimits, prompts: list[list[int]], max_tokens: int) -> None:
    try:
        for i, ids in enumerate(prompts):
            try:
                limits.check_fits_context(ids, max_tokens)
            except InvalidRequestError as e:
                if len(prompts) > 1:                  # a batch: say which prompt
                    e.message = f"prompt {i} of {len(prompts)}: {e.message}"
                    e.args = (e.message,)
                raise
    except InvalidRequestError as e:
        if kind is RequestKind.CHAT and e.param == "prompt":       # the chat API has no `prompt`
            raise APIError(e.message, 400, "invalid_request_error", "messages", e.code) from None
        raise


def tokenize_request(req: TokenizeRequest, tokenizer: Any | None) -> list[int]:
    """/tokenize: the token ids the completions API (a `prompt`) or the chat API (`messages`, `tools`) would
    run; `add_special_tokens` (prompt) and `add_generation_prompt` (messages) as vLLM's endpoint takes them."""
    if tokenizer is None:
        raise token_ids_only_error("prompt" if req.prompt is not None else "messages")
    if req.prompt is not None:
        return list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    return chat_prompt_ids(req.chat_request(), tokenizer)


def detokenize_request(req: DetokenizeRequest, tokenizer: Any | None) -> str:
    """/detokenize: the text of the token ids, special tokens kept (as an echoed prompt reads); an id outside
    the vocabulary is a 400."""
    if tokenizer is None:
        raise token_ids_only_error("tokens")
    vocab_size = len(tokenizer)
    bad = next((t for t in req.tokens if t >= vocab_size), None)
    if bad is not None:
        raise APIError(f"token id {bad} is outside this model's vocabulary (0..{vocab_size - 1})", 400,
                       "invalid_request_error", "tokens", "invalid_value")
    return _echo_text(req.tokens, tokenizer)
