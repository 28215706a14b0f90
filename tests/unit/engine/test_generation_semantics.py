"""Checkpoint and generation semantics (issue 31): every EOS id, min_tokens blocking EOS and stop ids,
unimplemented config fields refused, generation_config.json defaults, weight shapes checked before Ray."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.errors import ModelLoadError
from affinity_serve.engine.models.checkpoint import validate_checkpoint
from affinity_serve.engine.models.config import ModelArgs
from affinity_serve.engine.sampler import Sampler, SamplingInfo

PROMPT = [11, 57, 203, 98, 340, 12]


def _copy(src, tmp_path, name):
    d = tmp_path / name
    shutil.copytree(src, d)
    return d


def _edit_json(path: Path, **changes):
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _llm(path, **kw):
    return LLM(str(path), cache={"num_blocks": 32, "block_size": 8}, **kw)


def _greedy(llm, ids, **kw):
    kw = {"max_tokens": 12, "temperature": 0.0, **kw}
    return llm.generate([ids], SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


@pytest.fixture(scope="module")
def free_run(checkpoints):
    """The llama checkpoint's 12 greedy tokens after PROMPT with EOS ignored, and one token to make an EOS
    id: the first that appears at position >= 2 and not before."""
    out = _greedy(_llm(checkpoints["llama"]), PROMPT, ignore_eos=True).token_ids
    pos = next(i for i in range(2, len(out)) if out[i] not in out[:i])
    return out, pos


@pytest.mark.parametrize("where", ["generation_config.json", "config.json"])
def test_every_eos_id_stops_like_transformers(checkpoints, hf_reference, tmp_path, free_run, where):
    out, pos = free_run
    d = _copy(checkpoints["llama"], tmp_path, "multi_eos")
    primary = json.loads((d / "config.json").read_text())["eos_token_id"]
    _edit_json(d / where, eos_token_id=[primary, out[pos]])
    llm = _llm(d)
    assert llm.engine.eos_token_ids == (primary, out[pos])
    got = _greedy(llm, PROMPT)
    assert got.token_ids == out[:pos + 1] and got.finish_reason == "stop"
    if where == "generation_config.json":      # transformers reads its EOS ids from there: it stops there too
        with torch.no_grad():
            ref = hf_reference.model(str(d)).generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                                                      attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
        assert got.token_ids == ref[0, len(PROMPT):].tolist()
    # ignore_eos runs through every EOS id
    assert _greedy(llm, PROMPT, ignore_eos=True).token_ids == out


def test_min_tokens_masks_stop_token_ids_and_eos(checkpoints):
    llm = _llm(checkpoints["llama"])
    eos = llm.engine.eos_token_id
    forced = _greedy(llm, PROMPT, max_tokens=6, min_tokens=3, stop_token_ids=[42], logit_bias={42: 100.0})
    assert 42 not in forced.token_ids[:3]
    assert forced.token_ids[3] == 42 and len(forced.token_ids) == 4 and forced.finish_reason == "stop"
    forced = _greedy(llm, PROMPT, max_tokens=6, min_tokens=2, logit_bias={eos: 100.0})
    assert eos not in forced.token_ids[:2] and forced.token_ids[2:] == [eos] and forced.finish_reason == "stop"


def test_sampler_min_tokens_mask_counts_outputs_and_pending():
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3], eos_token_ids=(1, 2))
    logits = torch.zeros(1, 8)
    logits[0, 1] = logits[0, 2] = logits[0, 3] = 5.0
    logits[0, 6] = 1.0
    sampler = Sampler()
    one_out = SamplingInfo(params, [9, 9, 5], num_prompt_tokens=2)
    assert sampler.sample(logits, [one_out]).tolist() == [6]                       # 1 < 2 out: masked
    assert sampler.sample(logits, [one_out], pending=torch.tensor([5])).tolist() == [1]     # 2 out: free
    ignore = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3], eos_token_ids=(1, 2),
                            ignore_eos=True)
    assert sampler.sample(logits, [SamplingInfo(ignore, [9, 9], 2)]).tolist() == [1]   # EOS not masked


@pytest.mark.parametrize("field,value", [
    ("hidden_act", "gelu"), ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
    ("query_pre_attn_scalar", 256), ("partial_rotary_factor", 0.5), ("use_qk_norm", True),
    ("norm_type", "layer_norm"), ("num_local_experts", 8), ("embedding_multiplier", 12.0),
])
def test_unimplemented_config_fields_are_refused_naming_the_field(checkpoints, field, value):
    cfg = json.loads((Path(checkpoints["llama"]) / "config.json").read_text())
    cfg[field] = value
    with pytest.raises(ModelLoadError) as e:
        ModelArgs.from_dict(cfg)
    msg = str(e.value)
    assert field in msg and "LlamaForCausalLM" in msg and "\n" not in msg


def test_unimplemented_rope_and_norm_fields_are_refused(checkpoints):
    cfg = json.loads((Path(checkpoints["llama"]) / "config.json").read_text())
    for extra, field in [({"rope_scaling": {"rope_type": "default", "mrope_section": [16, 24, 24]}}, "mrope_section"),
                         ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
                         ({"layer_norm_eps": 1e-5, "rms_norm_eps": None}, "layer_norm_eps")]:
        c = {**cfg, **extra}
        if c.get("rms_norm_eps") is None:
            c.pop("rms_norm_eps")
        with pytest.raises(ModelLoadError, match=field):
            ModelArgs.from_dict(c)
    ok = {**cfg, "hidden_act": "silu", "attention_bias": True, "mlp_bias": True, "attn_logit_softcapping": None}
    assert ModelArgs.from_dict(ok).o_bias                      # implemented: accepted


def test_generation_config_defaults_apply_where_the_request_is_silent(checkpoints, hf_reference, tmp_path):
    d = _copy(checkpoints["llama"], tmp_path, "gen_defaults")
    _edit_json(d / "generation_config.json", temperature=0.0, top_p=0.8, top_k=20, repetition_penalty=1.0)
    llm = _llm(d)
    p = llm.engine.resolve_params(SamplingParams(max_tokens=8, ignore_eos=True))
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (0.0, 0.8, 20, 0.0)
    explicit = llm.engine.resolve_params(SamplingParams(temperature=0.7, top_k=5))
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (0.7, 0.8, 5)
    # the model's temperature 0 makes a silent request greedy: transformers' tokens
    out = llm.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_reference(str(d), PROMPT, 8)
    ignored = _llm(d, generation_config="ignore").engine.resolve_params(SamplingParams())
    assert (ignored.temperature, ignored.top_p, ignored.top_k) == (1.0, 1.0, None)


def test_weight_shape_mismatch_is_caught_before_ray_with_one_line(checkpoints, tmp_path, capsys):
    from affinity_serve.app.cli import main
    d = _copy(checkpoints["llama"], tmp_path, "bad_shape")
    _edit_json(d / "config.json", intermediate_size=96)                    # the weights have 128
    with pytest.raises(ModelLoadError) as e:
        validate_checkpoint(d)
    msg = str(e.value)
    assert msg == ("shape mismatch for model.layers.0.mlp.down_proj.weight: checkpoint (64, 128) vs model "
                   "(64, 96) (config.json does not describe these weights)")
    assert main(["serve", "--model", str(d)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "shape mismatch for model.layers.0.mlp." in err
