"""Tool calls (issue 27.3): `tools` with tool_choice "required" or a named function become a grammar on the
output, and that output becomes OpenAI `tool_calls` — whole, or as streamed `delta.tool_calls` fragments.

The grammar fixes the output's layout (compact JSON, properties in schema order), so it can be read back as it
streams without a model-specific parser:
- a named function: the output is the function's arguments, one JSON object;
- "required": `[{"name": "<one of the tools>", "arguments": {...}}, ...]` (one item unless parallel_tool_calls),
  each item's arguments valid against its function's parameters.
"auto" would need the model's own tool-call format (Hermes `<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`)
and is refused with a 400 that names what is supported.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from app.errors import APIError
from app.protocol import ChatCompletionRequest
from engine.structured_output import StructuredOutputSpec

#: a function with no `parameters` takes an empty object, as OpenAI documents
_NO_PARAMETERS = {"type": "object", "properties": {}}
_ITEM_HEAD = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')


@dataclass(frozen=True, slots=True)
class ToolCallMode:
    """How a chat response's output is read back: the named function's arguments (`function` set), or a list
    of calls ("required")."""

    function: str | None


def tool_call_grammar(req: ChatCompletionRequest) -> tuple[StructuredOutputSpec | None, ToolCallMode | None]:
    """The grammar and read-back mode that `tools`/`tool_choice` ask for; (None, None) for a plain answer.
    Raises APIError (400) for what is not supported or inconsistent."""
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
    if choice is None or choice == "auto":
        raise APIError("tool_choice 'auto' (the default when tools are given) is not supported: this server has no "
                       "model-specific tool-call parser; send tool_choice 'required', a named function "
                       "({'type': 'function', 'function': {'name': ...}}) or 'none'", 400, "invalid_request_error",
                       "tool_choice", "unsupported_value")
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

    def feed(self, text: str) -> list[dict]:
        self.text += text
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
