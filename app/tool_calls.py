"""Tool calls (issue 27.3): `tools` with tool_choice "required" or a named function become a grammar on the
output, and that output becomes OpenAI `tool_calls` — whole, or as streamed `delta.tool_calls` fragments.

The grammar fixes the output's layout (compact JSON, properties in schema order), so it can be read back as it
streams without a model-specific parser:
- a named function: the output is the function's arguments, one JSON object;
- "required": `[{"name": "<one of the tools>", "arguments": {...}}, ...]` (one item unless parallel_tool_calls),
  each item's arguments valid against its function's parameters.
"auto" lets the model choose between text and calls, so its own call format is read back from the text, the
parser chosen from the chat template (`detect_tool_parser`):
- `hermes` (Hermes, Qwen 2/2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere;
- `llama3_json` (Llama 3.1/3.2/3.3): the output is `{"name": ..., "parameters": {...}}` (several separated by
  `;`), after an optional `<|python_tag|>`, which also starts calls after some text when it reaches the text;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11), or
  `[TOOL_CALLS]name[ARGS]{...}` once per call (v11 and later; `[CALL_ID]id` may sit before `[ARGS]`), whose
  arguments stream as they are written. `[TOOL_CALLS]` and `[ARGS]` are special tokens, which the default
  `skip_special_tokens` drops from the text: an output that opens with such a JSON array, or with one of the
  request's function names and then `{`, is read as calls too.
The server's `serve.tool_call_parser` (`--tool-call-parser`) picks one of these for every model instead of the
template's, or `none` to refuse "auto"; templates with none of these formats keep "auto" a 400 that says what
is supported and how to choose a parser.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from affinity_serve.app.errors import APIError
from affinity_serve.app.protocol import ChatCompletionRequest
from affinity_serve.engine.errors import InvalidRequestError
from affinity_serve.engine.structured_output import StructuredOutputSpec, unenforced_schema_keyword

#: a function with no `parameters` takes an empty object, as OpenAI documents
_NO_PARAMETERS = {"type": "object", "properties": {}}
_ITEM_HEAD = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
#: the text that starts the calls, per JSON parser (special tokens: in the text only when not skipped)
_JSON_MARKERS = {"llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
#: an output opening like this is calls even without the marker (dropped from the text as a special token)
_JSON_OPENERS = {"llama3_json": re.compile(r"\s*\{"), "mistral": re.compile(r"\s*\[\s*\{")}
#: an output so far that may still open like that (held back, not sent as content)
_JSON_MAY_OPEN = {"llama3_json": re.compile(r"\s*"), "mistral": re.compile(r"\s*(\[\s*)?")}
#: Mistral v11+: a call's head, `name`, `[CALL_ID]id` maybe, then `[ARGS]` (dropped with special tokens)
_MISTRAL_HEAD = re.compile(r"([A-Za-z0-9_.:-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?(\[ARGS\])?")
TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
#: serve.tool_call_parser's values: "auto" reads the chat template (detect_tool_parser), "none" refuses "auto"
TOOL_PARSER_SETTINGS = ("auto", "none", *TOOL_PARSERS)


@dataclass(frozen=True, slots=True)
class ToolCallMode:
    """How a chat response's output is read back: the named function's arguments (`function` set), a list of
    calls ("required"), or (`parser` set, tool_choice "auto") text that may hold calls in that format."""

    function: str | None
    parser: str | None = None
    #: the request's function names ("auto"): an output that opens with one of them is a marker-less call
    names: tuple[str, ...] = ()

    @property
    def hermes(self) -> bool:
        return self.parser == "hermes"


def detect_tool_parser(tokenizer: Any | None) -> str | None:
    """The tool-call format a chat template writes (one of TOOL_PARSERS), or None: Hermes/Qwen's `<tool_call>`,
    Mistral's `[TOOL_CALLS]`, Llama 3's JSON calls (`<|python_tag|>`, or `"parameters"` in a template with
    Llama 3's headers)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):                   # named templates: the default, or all of them
        template = template.get("tool_use") or template.get("default") or " ".join(map(str, template.values()))
    template = str(template)
    if _HERMES_OPEN in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ('"parameters"' in template and "<|start_header_id|>" in template):
        return "llama3_json"
    return None


def resolve_tool_parser(setting: str, tokenizer: Any | None) -> str | None:
    """The parser that reads "auto" calls back under serve.tool_call_parser `setting` (TOOL_PARSER_SETTINGS):
    the named one, the chat template's ("auto"), or None ("none", or a template without a known format).
    Raises ValueError naming the choices for another setting."""
    if setting == "auto":
        return detect_tool_parser(tokenizer)
    if setting == "none":
        return None
    if setting not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {setting!r}: choose one of {', '.join(TOOL_PARSER_SETTINGS)}")
    return setting


def tool_call_grammar(req: ChatCompletionRequest, tokenizer: Any | None = None, parser_setting: str = "auto"
                      ) -> tuple[StructuredOutputSpec | None, ToolCallMode | None]:
    """The grammar and read-back mode that `tools`/`tool_choice` ask for; (None, None) for a plain answer.
    Whether "auto" can be read back: `parser_setting` (serve.tool_call_parser; "auto": `tokenizer`'s chat
    template decides). Raises APIError (400) for what is not supported or inconsistent."""
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
        parser = resolve_tool_parser(parser_setting, tokenizer)
        if parser is not None:
            return None, ToolCallMode(None, parser=parser, names=tuple(names))
        why = ("is turned off on this server (serve.tool_call_parser: none)" if parser_setting == "none" else
               "is not supported for this model: its chat template has no tool-call format this server reads "
               "(Hermes/Qwen <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS]; the operator can name one with "
               f"serve.tool_call_parser / --tool-call-parser: {', '.join(TOOL_PARSERS)})")
        raise APIError(f"tool_choice 'auto' (the default when tools are given) {why}; send tool_choice "
                       "'required', a named function ({'type': 'function', 'function': {'name': ...}}) or 'none'",
                       400, "invalid_request_error", "tool_choice", "unsupported_value")
    params = {t.function.name: t.function.parameters or _NO_PARAMETERS for t in req.tools}
    if choice == "required":
        for n, p in params.items():       # named here, not at its place in the array schema below
            problem = unenforced_schema_keyword(p)
            if problem is not None:
                raise InvalidRequestError(f"tools.{n}.parameters: unsupported JSON schema: {problem}",
                                          param=f"tools.{n}.parameters", code="invalid_grammar")
        defs: dict[str, Any] = {}
        items = [{"type": "object", "properties": {"name": {"const": n}, "arguments": _nested(p, i, defs)},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for i, (n, p) in enumerate(params.items())]
        schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
        if defs:
            schema["$defs"] = defs
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return StructuredOutputSpec.from_schema(schema, "tools"), ToolCallMode(None)
    name = choice.function.name
    if name not in params:
        raise APIError(f"tool_choice names the function {name[:64]!r}, which is not in tools ({', '.join(names)})",
                       400, "invalid_request_error", "tool_choice.function.name", "invalid_value")
    return StructuredOutputSpec.from_schema(params[name], f"tools.{name}.parameters"), ToolCallMode(name)


def _has_ref(node: Any) -> bool:
    if isinstance(node, dict):
        return isinstance(node.get("$ref"), str) or any(_has_ref(v) for v in node.values())
    return isinstance(node, list) and any(_has_ref(v) for v in node)


def _rebased(node: Any, base: str) -> Any:
    """`node` with every document-relative `$ref` ("#...") pointing under `base` instead of the root."""
    if isinstance(node, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebased(v, base) for v in node]
    return node


def _nested(parameters: Any, i: int, defs: dict[str, Any]) -> Any:
    """A function's parameters schema to nest inside the "required" array schema. References in it
    (`#/$defs/...`, `#/definitions/...`, `#`) are relative to the parameters' own root, which nesting moves:
    such a schema is kept whole in the array schema's `$defs` (as `tool_<i>`) with its references rebased,
    and referenced from there."""
    if not _has_ref(parameters):
        return parameters
    key = f"tool_{i}"
    defs[key] = _rebased(parameters, f"#/$defs/{key}")
    return {"$ref": f"#/$defs/{key}"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def read_calls(text: str, mode: ToolCallMode, final: bool = False) -> list[tuple[str, str, bool]]:
    """The calls in `text` so far: (function name, arguments text, arguments complete). A call appears once its
    name is complete; its arguments text grows as `text` does (a prefix of the final one). `final`: `text` is
    the whole output."""
    if mode.hermes:
        return [(name, args, True) for name, args, _ in _hermes_calls(text, final)[0]]
    if mode.parser is not None:
        return _json_section(text, mode)[1]
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


def _hermes_calls(text: str, final: bool = False) -> tuple[list[tuple[str, str, int]], str]:
    """Complete `<tool_call>` blocks whose JSON names a function, as (name, arguments JSON, end), and the text
    outside them. A block that is not such JSON stays text. With `final` (the whole output), a last block the
    model ended without its closing tag (EOS instead) is a call too if its JSON is one."""
    calls, content, pos = [], [], 0
    while (start := text.find(_HERMES_OPEN, pos)) != -1:
        end = text.find(_HERMES_CLOSE, start)
        if end == -1:
            call = _parse_call(text[start + len(_HERMES_OPEN):]) if final else None
            if call is not None:
                content.append(text[pos:start])
                calls.append((*call, len(text)))
                pos = len(text)
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
    return _as_call(call)


def _as_call(call: Any) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object (`arguments`, or Llama 3's `parameters`), else None."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    if not isinstance(args, (dict, str)):
        return None
    return call["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


_DECODER = json.JSONDecoder()


def _section_start(text: str, mode: ToolCallMode) -> tuple[int, int] | None:
    """Where `mode.parser`'s calls begin in `text`, and where their JSON (or Mistral v11's first name) does: at
    its marker, or at the start of an output that opens with the format's JSON or, Mistral v11, with one of
    the request's function names and then `{` (the markers dropped as special tokens); None if neither."""
    marker = _JSON_MARKERS[mode.parser]
    if (i := text.find(marker)) != -1:
        return i, i + len(marker)
    if (m := _JSON_OPENERS[mode.parser].match(text)) is not None:
        return 0, len(m.group()) - len(m.group().lstrip())
    if mode.parser == "mistral":
        start = len(text) - len(text.lstrip())
        head = _MISTRAL_HEAD.match(text, start)
        if head is not None and head.group(1) in mode.names and (head.group(2) or text.startswith("{", head.end())):
            return 0, start
    return None


def _may_open(text: str, mode: ToolCallMode) -> bool:
    """An output so far that may still open with marker-less calls (held back, not sent as content yet)."""
    if _JSON_MAY_OPEN[mode.parser].fullmatch(text):
        return True
    name = text.lstrip()
    return mode.parser == "mistral" and any(n.startswith(name) for n in mode.names)


def _json_calls(text: str, pos: int) -> tuple[list[tuple[str, str, bool]], int]:
    """The complete calls from `pos` on: call objects, bare or in one array, separated by blanks, `,` or `;`;
    and where the last one (or its array) ends. Stops at what is incomplete or not a call."""
    calls, end, in_array = [], pos, False
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,;":
            pos += 1
        if pos >= len(text):
            break
        if text[pos] in "[]":
            if (text[pos] == "[") == in_array:
                break                              # nested, or a stray bracket: not calls
            in_array = text[pos] == "["
            pos += 1
            end = pos if not in_array else end
            continue
        try:
            obj, nxt = _DECODER.raw_decode(text, pos)
        except ValueError:
            break                                  # incomplete (or not JSON)
        call = _as_call(obj)
        if call is None:
            break
        calls.append((*call, True))
        pos = end = nxt
    return calls, end


def _mistral_v11_calls(text: str, pos: int) -> tuple[list[tuple[str, str, bool]], int]:
    """Mistral v11+ calls from `pos` on (the first one's `[TOOL_CALLS]` already read): `name[ARGS]{...}`, each
    next one after its own `[TOOL_CALLS]`. A call counts once its name is complete (`[ARGS]` or `{` follows);
    the last one's arguments may be incomplete (then the calls end at the end of `text`)."""
    calls: list[tuple[str, str, bool]] = []
    end = pos
    while True:
        p = _skip_blanks(text, pos)
        if calls and text.startswith(_JSON_MARKERS["mistral"], p):
            p = _skip_blanks(text, p + len(_JSON_MARKERS["mistral"]))
        head = _MISTRAL_HEAD.match(text, p)
        if head is None:
            break
        args_at = _skip_blanks(text, head.end())
        if args_at == len(text) and head.group(2) is not None:
            calls.append((head.group(1), "", False))          # its arguments have not started
            return calls, len(text)
        if not text.startswith("{", args_at):
            break                                  # no call here (or its name is not complete yet)
        args_end = _value_end(text, args_at)
        calls.append((head.group(1), text[args_at:args_end], args_end is not None))
        if args_end is None:
            return calls, len(text)
        pos = end = args_end
    return calls, end


def _skip_blanks(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _json_section(text: str, mode: ToolCallMode) -> tuple[int, list[tuple[str, str, bool]], int]:
    """(where the calls begin, the calls as (name, arguments, complete), where they end) in a llama3_json or
    mistral output; no calls: (len(text), [], len(text))."""
    start = _section_start(text, mode)
    if start is None:
        return len(text), [], len(text)
    if mode.parser == "mistral" and not text.startswith(("[", "{"), _skip_blanks(text, start[1])):
        calls, end = _mistral_v11_calls(text, start[1])        # a name first: v11
    else:
        calls, end = _json_calls(text, start[1])
    return (start[0], calls, end) if calls else (len(text), [], len(text))


def auto_content(text: str, mode: ToolCallMode) -> str | None:
    """tool_choice "auto": the text of an answer outside its calls, as streamed (None when only whitespace)."""
    if mode.hermes:
        content = _hermes_calls(text, final=True)[1]
    else:
        start, _, end = _json_section(text, mode)
        content = text[:start] + text[end:]
    return content if content.strip() else None


def tool_calls_message(text: str, mode: ToolCallMode) -> list[dict]:
    """`message.tool_calls` for a whole output."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": args}}
            for name, args, _ in read_calls(text, mode, final=True)]


@dataclass(slots=True)
class ToolCallStream:
    """Turns one choice's streamed text into `delta.tool_calls` entries: a call's index, id, type and name first,
    then fragments of its arguments, as OpenAI streams them."""

    mode: ToolCallMode
    text: str = ""
    sent: list[int] = field(default_factory=list)      # per call: arguments characters sent so far
    content_sent: int = 0                               # hermes: characters of text passed on as content
    blank: str = ""                 # leading content that is only whitespace, held until other content comes
    content_started: bool = False

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """The `delta.tool_calls` entries `text` adds; `final`: it is the output's last piece."""
        self.text += text
        if self.mode.hermes:
            return self._feed_hermes(final)
        if self.mode.parser is not None:
            return self._feed_json()
        out = []            # at most one entry per call index in one delta, as OpenAI streams them
        for i, (name, args, _) in enumerate(read_calls(self.text, self.mode)):
            if i == len(self.sent):
                self.sent.append(len(args))
                out.append({"index": i, "id": new_call_id(), "type": "function",
                            "function": {"name": name, "arguments": args}})
            elif len(args) > self.sent[i]:
                out.append({"index": i, "function": {"arguments": args[self.sent[i]:]}})
                self.sent[i] = len(args)
        return out

    def take_content(self) -> str:
        """hermes: the text to send as content now (call the after `feed`). Text before a `<tool_call>` block
        goes out; a block is held until it closes (then it is a call, sent by `feed`, or, if its JSON is not a
        call, text); a suffix that may be the start of the tag is held back."""
        if self.mode.parser is not None and not self.mode.hermes:
            return self._take_json_content()
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

    def content(self, final: bool) -> str:
        """The content to send with this chunk (after `feed`): what `take_content` releases, and at the end what
        was held back. Whitespace before any other content is held, so that content that is only whitespace
        around calls is not sent at all, as the whole response's content is then null."""
        out = self.take_content() + (self.flush_content() if final else "")
        if not self.content_started:
            if not out.strip():
                self.blank += out
                if final and not self.sent:          # no call: the whole text is the answer, blanks and all
                    out, self.blank = self.blank, ""
                    return out
                return ""
            out, self.blank, self.content_started = self.blank + out, "", True
        return out

    def _feed_hermes(self, final: bool = False) -> list[dict]:
        out = []
        for i, (name, args, _) in enumerate(_hermes_calls(self.text, final)[0]):
            if i == len(self.sent):
                self.sent.append(len(args))
                out.append({"index": i, "id": new_call_id(), "type": "function",
                            "function": {"name": name, "arguments": args}})
        return out

    def _feed_json(self) -> list[dict]:
        """A call's index, id, name and arguments so far once its name is complete (llama3_json and old
        Mistral calls: once whole), then what its arguments grow by (Mistral v11)."""
        out = []
        for i, (name, args, _) in enumerate(_json_section(self.text, self.mode)[1]):
            if i == len(self.sent):
                self.sent.append(len(args))
                out.append({"index": i, "id": new_call_id(), "type": "function",
                            "function": {"name": name, "arguments": args}})
            elif len(args) > self.sent[i]:
                out.append({"index": i, "function": {"arguments": args[self.sent[i]:]}})
                self.sent[i] = len(args)
        return out

    def _take_json_content(self) -> str:
        """llama3_json/mistral: text before the calls goes out; from where they begin (the marker, or an output
        opening with their JSON) all is held; so is a suffix that may be the start of the marker, and an output
        so far that may still open with the calls."""
        text = self.text
        start = _section_start(text, self.mode)
        if start is not None:
            hold = max(start[0], self.content_sent)
        elif self.content_sent == 0 and _may_open(text, self.mode):
            hold = 0
        else:
            hold = len(text) - _partial_suffix(text, _JSON_MARKERS[self.mode.parser], self.content_sent)
        out, self.content_sent = text[self.content_sent:hold], max(hold, self.content_sent)
        return out

    def flush_content(self) -> str:
        """At the end ("auto"): the text still held back: an unclosed block or a partial tag is text; after
        llama3_json/mistral calls, what follows them; held JSON that held no call, all of it."""
        if self.mode.parser is None:       # a forced call: its text is content only if no call came of it
            if self.sent or self.content_sent:
                return ""
            self.content_sent = len(self.text)
            return self.text
        if self.mode.hermes:
            rest = self.text[self.content_sent:]
            if rest.startswith(_HERMES_OPEN) and _parse_call(rest[len(_HERMES_OPEN):]) is not None:
                self.content_sent = len(self.text)
                return ""                  # a last block without its closing tag: `feed` sent it as a call
        if not self.mode.hermes and self.sent:
            _, _, end = _json_section(self.text, self.mode)
            rest = self.text[end:]
            self.content_sent = len(self.text)
            return rest if rest.strip() else ""
        out, self.content_sent = self.text[self.content_sent:], len(self.text)
        return out


def _partial_suffix(text: str, marker: str, floor: int) -> int:
    """The length of the longest suffix of `text` (after `floor`) that `marker` starts with (0 if none)."""
    for k in range(min(len(marker) - 1, len(text) - floor), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
