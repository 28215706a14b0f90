"""Issue 27 against real Ray Serve: the official openai client (strict validation) gets schema-valid JSON for
response_format and validating tool calls (whole and streamed) from the replicas; a bad schema is a 400 and
the app keeps serving."""
import json

import openai
import pytest

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                           "ok": {"type": "boolean"},
                                           "tag": {"enum": ["a", "b", "c"]}},
          "required": ["id", "ok", "tag"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}]
MSGS = [{"role": "user", "content": "Look it up."}]


@pytest.fixture(scope="module")
def client(app_url):
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=60,
                         _strict_response_validation=True)


def test_response_format_json_schema(client):
    rf = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=MSGS, response_format=rf, max_tokens=60,
                                         temperature=1.0, seed=3, n=2)
    for c in out.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, response_format=rf, max_tokens=60,
                                                 temperature=0.0, stream=True))
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_call(client, stream):
    kw = dict(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=60, temperature=1.0, seed=4,
              tool_choice={"type": "function", "function": {"name": "lookup"}})
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "lookup"
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), SCHEMA)
        return
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "lookup" and deltas[0].id
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), SCHEMA)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_bad_schema_is_a_400_and_the_app_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, tools=TOOLS)   # auto
    assert client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2).choices
