"""The tool-call parser switch (serve.tool_call_parser, --tool-call-parser) and Mistral's v11+ call format
`[TOOL_CALLS]name[ARGS]{...}` beside the older `[TOOL_CALLS][{...}]` (issue 27), whole and streamed, through the
official openai client against a fake replica that writes a fixed text (tests/unit/app/test_tool_choice_auto.py)."""
from __future__ import annotations

import json
import typing

import openai
import pydantic
import pytest

from affinity_serve.app.config import AppConfig, ServeSection
from affinity_serve.app.tool_calls import (TOOL_PARSER_SETTINGS, TOOL_PARSERS, ToolCallMode, ToolCallStream,
                                           read_calls, resolve_tool_parser)
from tests.unit.app.test_tool_choice_auto import HERMES_TEMPLATE, MISTRAL_TEMPLATE, MSGS, TOOLS, TWO_TOOLS, _client

#: the demo model's own template: no tool-call format in it
PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HERMES_CALL = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
V11_TWO_CALLS = ('Let me check. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}'
                 '[TOOL_CALLS]get_time[ARGS]{}')
V11_TWO_CALLS_GOT = [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {})]


def test_the_config_field_offers_exactly_the_parsers_the_code_has():
    assert typing.get_args(ServeSection.model_fields["tool_call_parser"].annotation) == TOOL_PARSER_SETTINGS
    assert AppConfig().serve.tool_call_parser == "auto"


def test_an_unknown_parser_is_a_config_error_naming_the_field_and_the_choices():
    with pytest.raises(pydantic.ValidationError) as e:
        AppConfig.model_validate({"serve": {"tool_call_parser": "qwen25"}})
    assert "tool_call_parser" in str(e.value) and "llama3_json" in str(e.value)
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen25': choose one of auto, none, hermes"):
        resolve_tool_parser("qwen25", None)


def test_the_cli_flag_sets_the_field():
    from affinity_serve.app import cli
    assert cli.TOOL_CALL_PARSERS == TOOL_PARSER_SETTINGS
    args = cli._parser().parse_args(["serve", "--tool-call-parser", "mistral"])
    assert cli._overrides(args)["serve.tool_call_parser"] == "mistral"
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["serve", "--tool-call-parser", "qwen25"])


async def test_a_named_parser_reads_calls_a_template_without_a_format_cannot(checkpoints, tmp_path):
    client, ing, replica = _client(checkpoints, tmp_path, PLAIN_TEMPLATE)
    with pytest.raises(openai.BadRequestError) as e:          # auto: nothing to read calls with
        await client.chat.completions.create(model=ing.model_name, messages=MSGS, tools=TOOLS, max_tokens=50)
    assert e.value.body["param"] == "tool_choice" and "serve.tool_call_parser" in e.value.body["message"]
    client, ing, replica = _client(checkpoints, tmp_path / "2", PLAIN_TEMPLATE, {"tool_call_parser": "hermes"})
    replica.text = HERMES_CALL
    c = (await client.chat.completions.create(model=ing.model_name, messages=MSGS, tools=TOOLS,
                                              max_tokens=50)).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check. "     # as streamed
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]


async def test_a_named_parser_overrides_the_templates(checkpoints, tmp_path):
    """A Hermes template, the mistral parser configured: Mistral calls are read, a Hermes block is text."""
    client, ing, replica = _client(checkpoints, tmp_path, HERMES_TEMPLATE, {"tool_call_parser": "mistral"})
    replica.text = V11_TWO_CALLS
    c = (await client.chat.completions.create(model=ing.model_name, messages=MSGS, tools=TWO_TOOLS,
                                              max_tokens=80)).choices[0]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == V11_TWO_CALLS_GOT
    replica.text = HERMES_CALL
    c = (await client.chat.completions.create(model=ing.model_name, messages=MSGS, tools=TOOLS,
                                              max_tokens=50)).choices[0]
    assert c.message.tool_calls is None and c.message.content == HERMES_CALL and c.finish_reason == "stop"


async def test_none_refuses_auto_and_keeps_required_and_named_choices(checkpoints, tmp_path):
    client, ing, replica = _client(checkpoints, tmp_path, HERMES_TEMPLATE, {"tool_call_parser": "none"})
    with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model=ing.model_name, messages=MSGS, tools=TOOLS, tool_choice="auto",
                                             max_tokens=50)
    assert e.value.status_code == 400 and e.value.body["param"] == "tool_choice"
    assert "turned off on this server (serve.tool_call_parser: none)" in e.value.body["message"]
    replica.text = '{"city": "Paris"}'                 # a named function: its arguments, grammar-constrained
    c = (await client.chat.completions.create(
        model=ing.model_name, messages=MSGS, tools=TOOLS, max_tokens=50,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})).choices[0]
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris"}


# ---------------------------------------------------------------- Mistral v11+: [TOOL_CALLS]name[ARGS]{...}
MISTRAL = ToolCallMode(None, parser="mistral", names=("get_weather", "get_time"))


@pytest.mark.parametrize("text, calls, content", [
    (V11_TWO_CALLS, V11_TWO_CALLS_GOT, "Let me check. "),      # the content as streamed, blanks and all
    # [CALL_ID] before [ARGS]; blanks between calls
    ('[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "CET"} [TOOL_CALLS]get_time[ARGS]{}',
     [("get_time", {"tz": "CET"}), ("get_time", {})], None),
    # the markers dropped as special tokens: an output that opens with a request's function name and `{`
    ('get_weather{"city": "Paris"}get_time{}', [("get_weather", {"city": "Paris"}), ("get_time", {})], None),
    # text after the calls stays content; braces inside strings do not end the arguments
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa}ris{"} Done.', [("get_weather", {"city": "Pa}ris{"})], " Done."),
    # the older form still reads
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', [("get_time", {})], None),
    # no call: an unknown name without its marker, a name never followed by arguments
    ('weather{"city": "Paris"}', [], 'weather{"city": "Paris"}'),
    ("get_weather is what I would call.", [], "get_weather is what I would call."),
])
def test_mistral_reads_both_forms_whole(text, calls, content):
    from affinity_serve.app.tool_calls import auto_content
    got = read_calls(text, MISTRAL)
    assert [(n, json.loads(a)) for n, a, complete in got] == calls and all(c for *_, c in got)
    assert auto_content(text, MISTRAL) == content


def test_mistral_v11_arguments_cut_short_are_one_incomplete_call():
    got = read_calls('Hm. [TOOL_CALLS]get_weather[ARGS]{"city": "Par', MISTRAL)
    assert got == [("get_weather", '{"city": "Par', False)]
    assert read_calls("[TOOL_CALLS]get_weather[ARGS]", MISTRAL) == [("get_weather", "", False)]
    assert read_calls("[TOOL_CALLS]get_wea", MISTRAL) == []           # the name may still grow


@pytest.mark.parametrize("size", [1, 3, 7])
def test_mistral_v11_streams_the_name_first_then_argument_fragments(size):
    stream = ToolCallStream(MISTRAL)
    deltas, content = [], ""
    for i in range(0, len(V11_TWO_CALLS), size):
        deltas += stream.feed(V11_TWO_CALLS[i:i + size])
        content += stream.take_content()
    content += stream.flush_content()
    assert content == "Let me check. "
    heads = [d for d in deltas if "id" in d]
    assert [(h["index"], h["function"]["name"]) for h in heads] == [(0, "get_weather"), (1, "get_time")]
    for index, (name, args) in enumerate(V11_TWO_CALLS_GOT):
        parts = [d["function"]["arguments"] for d in deltas if d["index"] == index]
        assert json.loads("".join(parts)) == args
        if size == 1 and args:
            assert len(parts) > 5, "the arguments stream as they are written"
    first_fragment = next(i for i, d in enumerate(deltas) if d["index"] == 0 and "id" not in d)
    assert deltas.index(heads[0]) < first_fragment


@pytest.mark.parametrize("stream", [False, True])
async def test_mistral_v11_end_to_end(checkpoints, tmp_path, stream):
    client, ing, replica = _client(checkpoints, tmp_path, MISTRAL_TEMPLATE)
    replica.text = V11_TWO_CALLS
    kw = dict(model=ing.model_name, messages=MSGS, tools=TWO_TOOLS, max_tokens=80)
    if not stream:
        c = (await client.chat.completions.create(**kw)).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content == "Let me check. "     # as streamed
        got = [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
        assert len({t.id for t in c.message.tool_calls}) == 2
    else:
        chunks = [ch async for ch in await client.chat.completions.create(stream=True, **kw)]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Let me check. "
        deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        got = []
        for d in deltas:
            if d.id is not None:
                got.append([d.function.name, d.function.arguments or ""])
            else:
                got[d.index][1] += d.function.arguments
        got = [(n, json.loads(a)) for n, a in got]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert got == V11_TWO_CALLS_GOT


def test_every_parser_has_a_setting():
    assert set(TOOL_PARSERS) < set(TOOL_PARSER_SETTINGS)
