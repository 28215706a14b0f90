"""Tool calls (issue 27.3): `tools` with tool_choice "required" or a named function become a grammar on the
output, and that output becomes OpenAI `tool_calls` — whole, or as streamed `delta.tool_calls` fragments.

The grammar fixes the output's layout (compact JSON, properties in schema order), so it can be read back as it
streams without a model-specific parser:
- a named function: the output is the function's arguments, one JSON object;
- "required": `[{"name": "<one of the tools>", "arguments": {...}}, ...]` (one item unless parallel_tool_calls),
  each item's arguments valid against its function's parameters.
"auto" lets the model choose between text and calls, so it needs the model's own call format: the Hermes/Qwen
one (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, detected from a chat template that writes
`<tool_call>`) is read back from the text; for other templates (Llama 3 JSON, Mistral `[TOOL_CALLS]`) "auto" is
a 400 that names what is supported.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.errors import APIError
from app.protocol import ChatCompletionRequest
from engine.structured_output import StructuredOutputSpec

#: a function with no `parameters` takes an empty object, as OpenAI documents
_NO_PARAMETERS = {"type": "object", "properties": {}}
_ITEM_HEAD = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCallMode:
    """How a chat response's output is read back: the named function's arguments (`function` set), a list of
    calls ("required"), or (`hermes`, tool_choice "auto") text with `<tool_call>` blocks in it."""

    function: str | None
    hermes: bool = False


def tool_call_grammar(req: ChatCompletionRequest, tokenizer: Any | None = None
                      ) -> tuple[StructuredOutputSpec | None, ToolCallMode | None]:
    """The grammar and read-back mode that `tools`/`tool_choice` ask for; (None, None) for a plain answer.
    `tokenizer`'s chat template decides whether "auto" can be read back. Raises APIError (400) for what is not
    supported or inconsistent."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise APIError("tool_choice needs tools: give the functions in `tools`", 400, "invalid_request_error",
                           "tool_choice", "invalid_value")
        return None, None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise APIError("tools: function names must be unique", 400, "invalid_request_error", "tools",
                       "invalid_value")
    if choice == "none":
        return None, None
    if (choice is None or choice == "auto") and _HERMES_OPEN in str(getattr(tokenizer, "chat_template", "") or ""):
        return None, ToolCallMode(None, hermes=True)
    if choice is None or choice == "auto":
        raise APIError("tool_choice 'auto' (the default when tools are given) is not supported for this model: "
                       "its chat template has no tool-call format this server reads (Hermes/Qwen <tool_call>); "
                       "send tool_choice 'required', a named function ({'type': 'function', 'function': "
                       "{'name': ...}}) or 'none'", 400, "invalid_request_error", "tool_choice", "unsupported_value")
    params = {t.function.name: t.function.parameters or _NO_PARAMETERS for t in req.tools}
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                  "required": ["name", "arguments"], "additionalProperties": False} for n, p in params.items()]
        schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputSpec.from_schema(schema, "tools"), ToolCallMode(None)
    name = choice.function.name
    if name not in params:
        raise APIError(f"tool_choice names the function {name[:64]!r}, which is not in tools ({', '.join(names)})",
                       400, "invalid_request_error", "tool_choice.function.name", "invalid_value")
    return StructuredOutputSpec.from_schema(params[name], f"tools.{name}.parameters"), ToolCallMode(name)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_calls(text: str, mode: ToolCallMode) -> list[tuple[str, str, bool]]:
    """The calls in `text` so far: (function name, arguments text, arguments complete). A call appears once its
    name is complete; its arguments text grows as `text` does (a prefix of the final one)."""
    if mode.hermes:
        return [(name, args, True) for name, args, _ in _hermes_calls(text)[0]]
    if mode.function is not None:
        return [(mode.function, text, _value_end(text, 0) is not None)]
    calls = []
    pos = 1 if text.startswith("[") else len(text)
    while pos < len(text):
        m = _ITEM_HEAD.match(text, pos)
        if m is None:
            break                          # the next item's head is not complete yet
        start = m.end()
        end = _value_end(text, start)
        calls.append((json.loads(f'"{m.group(1)}"'), text[start:end], end is not None))
        if end is None:
            break
        pos = end + 1                      # past the item's closing brace
        if text.startswith(", ", pos):
            pos += 2
    return calls


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at `start` ends (exclusive); None if not complete yet."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _hermes_calls(text: str) -> tuple[list[tuple[str, str, int]], str]:
    """Complete `<tool_call>` blocks whose JSON names a function, as (name, arguments JSON, end), and the text
    outside them. A block that is not such JSON stays text."""
    calls, content, pos = [], [], 0
    while (start := text.find(_HERMES_OPEN, pos)) != -1:
        end = text.find(_HERMES_CLOSE, start)
        if end == -1:
            break
        stop = end + len(_HERMES_CLOSE)
        call = _parse_call(text[start + len(_HERMES_OPEN):end])
        if call is None:
            content.append(text[pos:stop])
        else:
            content.append(text[pos:start])
            calls.append((*call, stop))
        pos = stop
    content.append(text[pos:])
    return calls, "".join(content)


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a `<tool_call>` block's body, or None if it is not such JSON."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", {})
    return call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def hermes_content(text: str) -> str | None:
    """The text of a Hermes-format answer outside its calls (None when only whitespace)."""
    content = _hermes_calls(text)[1].strip()
    return content or None


def tool_calls_message(text: str, mode: ToolCallMode) -> list[dict]:
    """`message.tool_calls` for a whole output."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}
            for name, args, _ in read_calls(text, mode)]


@dataclass(slots=True)
class ToolCallStream:
    """Turns one choice's streamed text into `delta.tool_calls` entries: a call's index, id, type and name first,
    then fragments of its arguments, as OpenAI streams them."""

    mode: ToolCallMode
    text: str = ""
    sent: list[int] = field(default_factory=list)      # per call: arguments characters sent so far
    content_sent: int = 0                               # hermes: characters of text passed on as content

    def feed(self, text: str) -> list[dict]:
        self.text += text
        if self.mode.hermes:
            return self._feed_hermes()
        out = []
        for i, (name, args, _) in enumerate(read_calls(self.text, self.mode)):
            if i == len(self.sent):
                self.sent.append(0)
                out.append({"index": i, "id": new_call_id(), "type": "function",
                            "function": {"name": name, "arguments": ""}})
            if len(args) > self.sent[i]:
                out.append({"index": i, "function": {"arguments": args[self.sent[i]:]}})
                self.sent[i] = len(args)
        return out

    def take_content(self) -> str:
        """hermes: the text to send as content now (call the after `feed`). Text before a `<tool_call>` block
        goes out; a block is held until it closes (then it is a call, sent by `feed`, or, if its JSON is not a
        call, text); a suffix that may be the start of the tag is held back."""
        if not self.mode.hermes:
            return ""
        out, pos, text = [], self.content_sent, self.text
        while True:
            start = text.find(_HERMES_OPEN, pos)
            if start == -1:
                hold = len(text)
                for k in range(min(len(_HERMES_OPEN) - 1, len(text) - pos), 0, -1):
                    if _HERMES_OPEN.startswith(text[-k:]):
                        hold = len(text) - k
                        break
                out.append(text[pos:hold])
                pos = hold
                break
            out.append(text[pos:start])
            end = text.find(_HERMES_CLOSE, start)
            if end == -1:
                pos = start
                break
            stop = end + len(_HERMES_CLOSE)
            if _parse_call(text[start + len(_HERMES_OPEN):end]) is None:
                out.append(text[start:stop])          # not a call: it was text after all
            pos = stop
        self.content_sent = pos
        return "".join(out)

    def _feed_hermes(self) -> list[dict]:
        out = []
        for i, (name, args, _) in enumerate(_hermes_calls(self.text)[0]):
            if i == len(self.sent):
                self.sent.append(len(args))
                out.append({"index": i, "id": new_call_id(), "type": "function",
                            "function": {"name": name, "arguments": args}})
        return out

    def flush_content(self) -> str:
        """hermes, at the end: the text still held back (an unclosed block or a partial tag is text)."""
        if not self.mode.hermes:
            return ""
        out, self.content_sent = self.text[self.content_sent:], len(self.text)
        return out
