"""Tokenizer loading, chat templates, and incremental detokenization with stop strings."""
from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

from affinity_serve.engine.errors import InvalidRequestError, ModelLoadError
from affinity_serve.engine.models.checkpoint import check_tokenizer_files


def load_tokenizer(path: str | Path):
    """The checkpoint directory's own tokenizer (and chat template), via transformers, offline. `path` may
    be a hub id, `org/name[@revision]` (engine/models/hub.py; its tokenizer files only are fetched).

    Raises ModelLoadError naming the files looked for when there are none (see check_tokenizer_files).
    """
    from transformers import AutoTokenizer

    from affinity_serve.engine.models.hub import resolve_model_path
    path = resolve_model_path(str(path), weights=False)
    check_tokenizer_files(path)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises several types for a missing/broken tokenizer
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ModelLoadError(f"could not load a tokenizer from {str(path)!r}: {why}") from e


def token_ids_only_error(param: str) -> InvalidRequestError:
    """The 400 for text input (a text prompt, chat messages, stop strings) when no tokenizer is loaded."""
    what = {"messages": "chat messages need", "stop": "stop strings need"}.get(param, "a text prompt needs")
    return InvalidRequestError(
        f"{what} a tokenizer, and this model is served in token-ids-only mode (skip_tokenizer_init: true): "
        "send the prompt as a list of token ids" + (" and use stop_token_ids" if param == "stop" else "")
        + ", or turn skip_tokenizer_init off", param=param, code="tokenizer_not_loaded")


#: apply_chat_template's own parameters and the renderer's: a template variable may not take one of these names
#: (with the installed transformers' signatures added at first use: a name it gains later is refused too)
_TEMPLATE_RESERVED = frozenset({"conversation", "conversations", "messages", "tools", "documents", "chat_template",
                                "tokenize", "add_generation_prompt", "continue_final_message", "padding",
                                "truncation", "max_length", "return_tensors", "return_dict",
                                "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


@functools.cache
def _reserved_template_names() -> frozenset[str]:
    names = set(_TEMPLATE_RESERVED)
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.utils.chat_template_utils import render_jinja_template
        for fn in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template):
            names |= {n for n, p in inspect.signature(fn).parameters.items()
                      if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "self"}
    except (ImportError, AttributeError, ValueError, TypeError):
        # a transformers without these names or signatures: the fixed list above is what there is to refuse
        return _TEMPLATE_RESERVED
    return frozenset(names)


def check_template_kwargs(kwargs: dict[str, Any] | None, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """The extra variables a request hands the chat template (e.g. Qwen3's `enable_thinking`): names only, none
    of apply_chat_template's own parameters; raises InvalidRequestError naming the key."""
    out = dict(kwargs or {})
    for k in out:
        if not isinstance(k, str) or not k.isidentifier() or k in _reserved_template_names():
            raise InvalidRequestError(f"{param}: {str(k)[:40]!r} cannot be a chat template variable (use a name "
                                      f"that is none of {', '.join(sorted(_reserved_template_names()))})",
                                      param=param)
    return out


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                        continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt's token ids as the model's chat template renders `messages` (and `tools`); `template_kwargs`
    are extra template variables (checked by check_template_kwargs); `continue_final_message` leaves the last
    message open for the model to continue (then no generation prompt)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidRequestError(f"messages[{i}] must be an object with 'role' and 'content'",
                                      param=f"messages[{i}]")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; use the completions API",
                                  param="messages")
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true (set "
                                  "add_generation_prompt: false)", param="continue_final_message")
    if continue_final_message and messages[-1].get("role") != "assistant":
        raise InvalidRequestError("continue_final_message continues the last message, which must be the "
                                  "assistant's", param="continue_final_message")
    extra = check_template_kwargs(template_kwargs)
    if tools is not None:
        extra["tools"] = tools
    if continue_final_message:
        extra["continue_final_message"] = True
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                            **extra)
    except Exception as e:        # the template refused these messages (its raise_exception, a jinja error)
        from jinja2 import TemplateError
        if not isinstance(e, (TemplateError, TypeError, ValueError, KeyError)):
            raise
        param = "chat_template_kwargs" if template_kwargs else "messages"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise InvalidRequestError(f"the model's chat template cannot render this request: {first}",
                                  param=param) from None
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Multi-byte characters split across tokens are held back until complete (a trailing U+FFFD
    means "not yet"). Stop strings end the text before the match (or after it with
    include_stop_str_in_output); while streaming, the last `max(len(stop)) - 1` characters are held
    back so a stop string spanning two deltas is never half-emitted.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stop = list(stop or [])
        self._include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""               # decoded text so far (complete characters only)
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0
        self.stop_hit: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip, clean_up_tokenization_spaces=False)

    def skip(self, token_ids: list[int]) -> None:
        """Take `token_ids` as output whose text was sent elsewhere (P/D: the prefill engine's first token), as
        far as that engine sent it: it took them as an unfinished stream does, so it held back a character they
        only began and the last characters a stop string could start with; those are sent from here."""
        self.update(token_ids, False)

    def update(self, new_token_ids: list[int], finished: bool) -> str:
        """Add tokens; return the text delta to emit now. Sets `stop_hit` when a stop string matched."""
        if self.stop_hit is not None:
            return ""
        self.token_ids.extend(new_token_ids)
        prefix = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset:])
        if len(full) > len(prefix) and (finished or not full.endswith("\ufffd")):
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
        end = len(self.text)
        if self._stop:
            search_from = max(0, self._emitted - self._hold)
            hit = _find_first(self.text, self._stop, search_from)
            if hit is not None:
                pos, s = hit
                self.stop_hit = s
                end = pos + len(s) if self._include_stop else pos
                self.text = self.text[:end]
                finished = True
        if not finished:
            end = max(self._emitted, end - self._hold)
        delta = self.text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return delta


def _find_first(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
