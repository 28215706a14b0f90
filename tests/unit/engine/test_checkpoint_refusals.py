"""Checkpoints the model code would compute garbage from are refused in one line, by the pre-flight check
(validate_checkpoint, before Ray) and by the loader alike: a quantization_config, and checkpoint tensors no
parameter takes (another architecture's q/k norms, fp8 scales). Known harmless extras still load."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from affinity_serve.engine import validate_checkpoint
from affinity_serve.engine.errors import ModelLoadError
from affinity_serve.engine.models.config import ModelArgs
from affinity_serve.engine.models.loader import load_model
from tests.unit.engine.tiny_hf import write_tiny_hf


def _copy(src, tmp_path, name="m") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(d: Path, edit) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})


def _refused_everywhere(d: Path, pattern: str) -> None:
    """The pre-flight check and the loader refuse `d` with the same one-line message."""
    with pytest.raises(ModelLoadError, match=pattern) as pre:
        validate_checkpoint(d)
    with pytest.raises(ModelLoadError, match=pattern) as load:
        load_model(d, torch.float32, torch.device("cpu"), 64)
    assert "\n" not in str(pre.value) and str(pre.value) == str(load.value)


def _loads(d: Path):
    validate_checkpoint(d)
    return load_model(d, torch.float32, torch.device("cpu"), 64)


@pytest.mark.parametrize("quant", [{"quant_method": "fp8", "activation_scheme": "dynamic"},
                                   {"quant_method": "awq", "bits": 4, "group_size": 128}])
def test_a_quantization_config_is_refused_naming_the_field(checkpoints, tmp_path, quant):
    d = _copy(checkpoints["llama"], tmp_path)
    _edit_config(d, quantization_config=quant)
    with pytest.raises(ModelLoadError, match=rf"quantization_config.*{quant['quant_method']}.*supported: "
                                             r"none \(unquantized"):
        ModelArgs.from_dir(d)
    _refused_everywhere(d, "quantization_config")


def test_a_qwen3_checkpoint_labelled_llama_is_refused_for_its_qk_norms(tmp_path):
    d = write_tiny_hf(tmp_path / "q3", "Qwen3Config", head_dim=16)
    _edit_config(d, architectures=["LlamaForCausalLM"], model_type="llama")
    _refused_everywhere(d, r"checkpoint tensor 'model\.layers\.0\.self_attn\.[qk]_norm\.weight' has no place "
                           r"in LlamaForCausalLM")


def test_fp8_scale_tensors_are_refused(checkpoints, tmp_path):
    d = _copy(checkpoints["llama"], tmp_path)
    _edit_tensors(d, lambda t: t.update({"model.layers.1.mlp.down_proj.weight_scale_inv": torch.ones(1, 1)}))
    _refused_everywhere(d, r"'model\.layers\.1\.mlp\.down_proj\.weight_scale_inv' has no place")


def test_rope_inverse_frequency_buffers_of_older_checkpoints_still_load(checkpoints, tmp_path):
    d = _copy(checkpoints["llama"], tmp_path)
    _edit_tensors(d, lambda t: t.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(8)
                                         for i in range(2)}))
    _loads(d)


def test_a_tied_checkpoint_may_ship_its_lm_head_only_identical_to_the_embeddings(checkpoints, tmp_path):
    same = _copy(checkpoints["llama"], tmp_path, "same")
    _edit_config(same, tie_word_embeddings=True)
    _edit_tensors(same, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    model, args = _loads(same)
    assert args.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight

    differs = _copy(checkpoints["llama"], tmp_path, "differs")        # its own lm_head, the config says tied
    _edit_config(differs, tie_word_embeddings=True)
    _refused_everywhere(differs, "tie_word_embeddings is true but the checkpoint's lm_head.weight differs")


@pytest.mark.parametrize("change, pattern", [
    (dict(num_hidden_layers=3), r"missing weights config.json asks for \(6: layers\.2\.input_layernorm\.weight"),
    (dict(attention_bias=True), r"missing weights .*layers\.0\.self_attn\.qkv_proj\.bias"),
    (dict(mlp_bias=True), r"missing weights .*layers\.0\.mlp\.gate_up_proj\.bias"),
])
def test_weights_config_json_asks_for_and_the_file_lacks_are_named(checkpoints, tmp_path, change, pattern):
    d = _copy(checkpoints["llama"], tmp_path)
    _edit_config(d, **change)
    _refused_everywhere(d, pattern)


def test_an_untied_config_without_lm_head_is_refused_before_loading(checkpoints, tmp_path):
    d = _copy(checkpoints["llama"], tmp_path)
    _edit_tensors(d, lambda t: t.pop("lm_head.weight"))
    _refused_everywhere(d, "checkpoint has no lm_head.weight and tie_word_embeddings is false")


def test_a_truncated_weight_file_is_one_line_naming_it(checkpoints, tmp_path):
    d = _copy(checkpoints["llama"], tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:len(data) // 2])
    _refused_everywhere(d, r"cannot read weight file 'model\.safetensors' in .*truncated or corrupt download")
