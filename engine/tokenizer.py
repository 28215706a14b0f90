"""Tokenizer loading, chat templates, and incremental detokenization with stop strings."""
from __future__ import annotations

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
        raise ModelLoadError(f"could not load a tokenizer from {str(path)!r}: {e}") from e


def token_ids_only_error(param: str) -> InvalidRequestError:
    """The 400 for text input (a text prompt, chat messages, stop strings) when no tokenizer is loaded."""
    what = {"messages": "chat messages need", "stop": "stop strings need"}.get(param, "a text prompt needs")
    return InvalidRequestError(
        f"{what} a tokenizer, and this model is served in token-ids-only mode (skip_tokenizer_init: true): "
        "send the prompt as a list of token ids" + (" and use stop_token_ids" if param == "stop" else "")
        + ", or turn skip_tokenizer_init off", param=param, code="tokenizer_not_loaded")


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidRequestError(f"messages[{i}] must be an object with 'role' and 'content'",
                                      param=f"messages[{i}]")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template; use the completions API",
                                  param="messages")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
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
        """Take `token_ids` as context whose text was sent elsewhere (P/D: the prefill engine's first token)."""
        self.update(token_ids, False)
        self._emitted = len(self.text)

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
