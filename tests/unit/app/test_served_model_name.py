"""The name clients send as `model` defaults to the checkpoint directory's name, also when the path names it
only relatively (`affinity-serve serve .` inside the checkpoint served it as "")."""
import pytest

from affinity_serve.app.builder import resolve_model
from affinity_serve.app.cli import ready_message
from affinity_serve.app.config import AppConfig, served_model_name


def _cfg(model: str, **serve) -> AppConfig:
    return AppConfig.model_validate({"engine": {"model": model}, "serve": serve})


@pytest.mark.parametrize("where, model", [("inside", "."), ("inside", "./"), ("below", ".."),
                                          ("beside", "tiny-llama"), ("beside", "tiny-llama/")])
def test_the_default_name_is_the_resolved_directorys(tmp_path, monkeypatch, where, model):
    d = tmp_path / "tiny-llama"
    (d / "sub").mkdir(parents=True)
    monkeypatch.chdir({"inside": d, "below": d / "sub", "beside": tmp_path}[where])
    cfg = resolve_model(_cfg(model))
    assert served_model_name(cfg) == "tiny-llama"        # what the ingress serves
    assert cfg.engine.model == model                    # the path itself is kept as given
    assert '"model": "tiny-llama"' in ready_message(cfg)


def test_an_explicit_name_and_a_hub_id_are_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_model(_cfg(".", model_name="mine")).serve.model_name == "mine"
    cfg = resolve_model(_cfg("Qwen/Qwen3-0.6B"))
    assert cfg.serve.model_name is None and served_model_name(cfg) == "Qwen/Qwen3-0.6B"
    assert '"model": "Qwen/Qwen3-0.6B"' in ready_message(cfg)          # the ready message's curl says the same
