"""flash-attn backend on a real GPU: same tokens as the torch backend. Skipped cleanly without CUDA."""
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_flash_matches_torch_backend_greedy(checkpoints):
    pytest.importorskip("flash_attn", reason="needs the flash-attn package (pip install '.[gpu]')")
    from engine import LLM, SamplingParams

    path = checkpoints["llama"]
    prompts = [[10 + i for i in range(n)] for n in (5, 40, 300)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = {}
    for backend in ("torch", "flash"):
        llm = LLM(path, device="cuda", dtype="bfloat16", attention_backend=backend,
                  cache={"block_size": 256, "num_blocks": 16})
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs["flash"] == outs["torch"]


def test_torch_backend_on_gpu_matches_transformers(checkpoints, hf_reference):
    from engine import LLM, SamplingParams

    path = checkpoints["qwen2"]
    ids = [11, 22, 33, 44, 55, 66, 77]
    llm = LLM(path, device="cuda", dtype="float32", attention_backend="torch")
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_reference(path, ids, 8)
