import json
import shutil

import pytest

from affinity_serve.engine.errors import ModelLoadError
from affinity_serve.engine.models.config import ModelArgs


def _copy(src, tmp_path, name="m"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_names_what_was_found(checkpoints, tmp_path):
    d = _copy(checkpoints["llama"], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        ModelArgs.from_dir(d)


def test_missing_files_are_named(checkpoints, tmp_path):
    from affinity_serve.engine.models.loader import load_model
    import torch
    with pytest.raises(ModelLoadError, match="not a directory"):
        ModelArgs.from_dir(tmp_path / "nope")
    d = _copy(checkpoints["llama"], tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(d, torch.float32, torch.device("cpu"), 64)
    d2 = _copy(checkpoints["llama_tied_sharded"], tmp_path, "sharded")
    next(d2.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(d2, torch.float32, torch.device("cpu"), 64)
    d3 = _copy(checkpoints["llama"], tmp_path, "noconfig")
    (d3 / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        ModelArgs.from_dir(d3)


def test_unsupported_rope_type(checkpoints):
    cfg = json.loads((__import__("pathlib").Path(checkpoints["llama"]) / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "longrope", "factor": 2}
    with pytest.raises(ModelLoadError, match="longrope"):
        ModelArgs.from_dict(cfg)


def test_bfloat16_load_runs(checkpoints):
    from affinity_serve.engine import LLM, SamplingParams
    llm = LLM(checkpoints["llama"], dtype="bfloat16", cache={"num_blocks": 32})
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    import torch
    assert llm.engine.runner.kv_caches[0].dtype == torch.bfloat16


def test_max_model_len_capped_by_kv_capacity_and_published(checkpoints):
    from affinity_serve.engine.config import EngineConfig
    from affinity_serve.engine.limits import EngineLimits
    from affinity_serve.engine.llm_engine import LLMEngine
    cfg = EngineConfig(model=checkpoints["llama"], cache={"num_blocks": 9, "block_size": 4})
    eng = LLMEngine.from_config(cfg)
    assert eng.max_model_len == 32
    assert eng.limits == EngineLimits(max_model_len=32, vocab_size=eng.model_args.vocab_size, max_kv_tokens=32,
                                      block_size=4)


def test_linear_backend_choice_and_packed_linear_equals_f_linear():
    import torch
    import torch.nn.functional as F

    from affinity_serve.engine.build import pick_linear_backend
    from affinity_serve.engine.models.linear import PackedLinear, prepack_supported

    cpu = torch.device("cpu")
    assert pick_linear_backend("torch", cpu, torch.float32) == "torch"
    assert pick_linear_backend("auto", torch.device("cuda"), torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="linear_backend 'onednn' needs a CPU device"):
        pick_linear_backend("onednn", torch.device("cuda"), torch.float16)
    if not prepack_supported(cpu, torch.float32):
        pytest.skip("this torch build has no oneDNN")
    # auto: the plain copy beside the packed weights while it costs at most 1 GiB, packed alone above
    assert pick_linear_backend("auto", cpu, torch.float32, 1 << 30) == "hybrid"
    assert pick_linear_backend("auto", cpu, torch.float32, (1 << 30) + 1) == "onednn"
    assert pick_linear_backend("hybrid", cpu, torch.float32, 1 << 40) == "hybrid"
    with pytest.raises(ValueError, match="linear_backend 'hybrid' needs a CPU device"):
        pick_linear_backend("hybrid", cpu, torch.float16)
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    for bias in (None, b):
        for plain_rows in (0, 2):
            lin = PackedLinear(w, bias, plain_rows)
            assert (lin.plain_t is not None) == (plain_rows > 0)
            for shape in ((1, 40), (2, 40), (3, 40), (33, 40), (2, 5, 40), (1, 1, 40)):
                x = torch.randn(*shape, generator=g)
                torch.testing.assert_close(lin(x), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
            x = torch.randn(40, 7, generator=g).t()                 # non-contiguous input
            torch.testing.assert_close(lin(x), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    # rows <= plain_rows multiply the plain [in, out] copy: bit-equal to that addmm
    lin = PackedLinear(w, b, 2)
    for rows in (1, 2):
        x = torch.randn(rows, 40, generator=g)
        assert torch.equal(lin(x), torch.addmm(b, x, w.t().contiguous()))


def test_plain_copy_bytes_counts_the_linears_hybrid_duplicates(checkpoints):
    import torch

    from affinity_serve.engine.build import plain_copy_bytes
    from affinity_serve.engine.models.loader import load_model
    for name in ("llama", "llama_tied_sharded"):
        model, args = load_model(checkpoints[name], torch.float32, torch.device("cpu"), 64)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert plain_copy_bytes(args, torch.float32) == sum(m.weight.numel() * 4 for m in linears)
        assert plain_copy_bytes(args, torch.bfloat16) * 2 == plain_copy_bytes(args, torch.float32)


def test_validate_checkpoint_checks_what_the_loader_needs(checkpoints, tmp_path):
    from affinity_serve.engine.models.checkpoint import validate_checkpoint
    assert validate_checkpoint(checkpoints["llama"]).architecture == "LlamaForCausalLM"
    d = _copy(checkpoints["llama_tied_sharded"], tmp_path, "sharded")
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="lists shards that are missing"):
        validate_checkpoint(d)
    d = _copy(checkpoints["llama"], tmp_path, "badjson")
    (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="is not valid JSON"):
        validate_checkpoint(d)
    cfg = json.loads((_copy(checkpoints["llama"], tmp_path, "nokey") / "config.json").read_text())
    del cfg["hidden_size"]
    with pytest.raises(ModelLoadError, match="config.json has no 'hidden_size'"):
        ModelArgs.from_dict(cfg)
    d = _copy(checkpoints["llama"], tmp_path, "notok")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"looked for tokenizer.json, tokenizer.model, vocab.json.*"
                                             r"tokenizer_config.json.*skip_tokenizer_init: true"):
        validate_checkpoint(d)
    assert validate_checkpoint(d, need_tokenizer=False).vocab_size > 0


def test_packed_linears_run_a_bounded_set_of_row_counts_and_match_f_linear():
    """oneDNN caches one primitive per row count: padding rows to buckets keeps that set small (a soak's
    heap grew without it) and the rows that matter equal F.linear's."""
    import torch

    from affinity_serve.engine.models.linear import PackedLinear, prepack_supported, row_bucket
    assert [row_bucket(n) for n in (1, 8, 9, 16, 17, 64, 65, 128, 129, 2048)] == [1, 8, 16, 16, 24, 64, 128, 128,
                                                                                 192, 2048]
    assert len({row_bucket(n) for n in range(1, 2049)}) <= 8 + 7 + 31
    if not prepack_supported(torch.device("cpu"), torch.float32):
        return
    torch.manual_seed(0)
    w, b = torch.randn(48, 40), torch.randn(48)
    lin = PackedLinear(w, b)
    for n in (3, 9, 37, 65, 130):
        x = torch.randn(n, 40)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
        x3 = torch.randn(2, n, 40)
        assert lin(x3).shape == (2, n, 48)
