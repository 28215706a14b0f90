"""serve.chat_template (vLLM's --chat-template): a template for a model whose tokenizer has none (a base model),
or another one; given as text or a file, checked when the config loads."""
from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import openai
import pytest

from affinity_serve.app.config import AppConfig, ConfigError
from affinity_serve.app.prompts import RequestKind
from tests.unit.app.conftest import LocalHandle
from tests.unit.app.test_hostile_inputs import http_request
from tests.unit.app.test_tool_choice_auto import TextReplica

TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}<<assistant>>"


def _base_model(checkpoints, tmp_path):
    """A copy of the tiny model whose tokenizer has no chat template."""
    path = tmp_path / "base"
    shutil.copytree(checkpoints["llama"], path)
    (path / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def _client(path, serve: dict):
    from affinity_serve.app.ingress import Ingress
    replica = TextReplica()
    replica.text = "ok"
    ing = Ingress(LocalHandle(replica), AppConfig.model_validate(
        {"engine": {"model": str(path)}, "serve": {"first_token_timeout_s": 5, **serve}}))

    async def handler(request: httpx.Request) -> httpx.Response:
        r = await asyncio.wait_for(ing._http(RequestKind.CHAT, http_request(request.content, request.url.path)), 10)
        return httpx.Response(r.status_code, content=r.body, headers={"content-type": "application/json"})

    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", max_retries=0,
                                http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    return client, ing, replica


async def test_a_base_model_chats_with_the_configured_template(checkpoints, tmp_path):
    path = _base_model(checkpoints, tmp_path)
    msgs = [{"role": "user", "content": "hi there"}]
    client, ing, _ = _client(path, {})
    with pytest.raises(openai.BadRequestError):                  # no template: chat is a 400
        await client.chat.completions.create(model=ing.model_name, messages=msgs, max_tokens=2)
    file = tmp_path / "t.jinja"
    file.write_text(TEMPLATE)
    for value in (TEMPLATE, str(file)):
        client, ing, replica = _client(path, {"chat_template": value})
        out = await client.chat.completions.create(model=ing.model_name, messages=msgs, max_tokens=2)
        assert out.choices[0].message.content == "ok"
        assert ing.serving.tokenizer.decode(replica.prompts[-1]).endswith("<<user>>hi there<<assistant>>")


def test_templates_transformers_compiles_are_accepted():
    """Loop controls and {% generation %} are transformers' extensions, used by real templates."""
    for t in ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
              "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"):
        cfg = AppConfig.model_validate({"engine": {"model": "/m"}, "serve": {"chat_template": t}})
        assert cfg.serve.chat_template == t


@pytest.mark.parametrize("value,says", [("no/such/file.jinja", "neither a file nor a Jinja template"),
                                        ("{% for m in messages %}", "does not compile")])
def test_a_template_that_is_not_one_is_a_config_error(value, says):
    with pytest.raises((ConfigError, ValueError)) as e:
        AppConfig.model_validate({"engine": {"model": "/m"}, "serve": {"chat_template": value}})
    assert says in str(e.value) and "chat_template" in str(e.value)


def test_the_served_name_of_a_hub_id_is_the_id_as_vllm_serves_it(tmp_path):
    from affinity_serve.app.config import served_model_name

    def name(model, **serve):
        return served_model_name(AppConfig.model_validate({"engine": {"model": model}, "serve": serve}))
    assert name("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert name("Qwen/Qwen3-0.6B@main") == "Qwen/Qwen3-0.6B"
    assert name("Qwen/Qwen3-0.6B", model_name="qwen") == "qwen"
    local = tmp_path / "org" / "tiny"
    local.mkdir(parents=True)
    assert name(str(local)) == "tiny"                  # a local directory: its name


def test_the_cli_flag_sets_the_field(tmp_path):
    from affinity_serve.app import cli
    args = cli._parser().parse_args(["serve", "--chat-template", "t.jinja"])
    assert cli._overrides(args)["serve.chat_template"] == "t.jinja"
