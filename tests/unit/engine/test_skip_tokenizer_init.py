"""Token-ids-only mode (skip_tokenizer_init): a checkpoint without tokenizer files serves token-id prompts."""
import shutil

import pytest

from affinity_serve.engine import LLM, SamplingParams
from affinity_serve.engine.errors import InvalidRequestError, ModelLoadError


@pytest.fixture(scope="module")
def no_tokenizer_dir(checkpoints, tmp_path_factory):
    d = tmp_path_factory.mktemp("notok") / "m"
    shutil.copytree(checkpoints["llama"], d)
    for f in d.iterdir():
        if f.name not in ("config.json", "generation_config.json", "model.safetensors"):
            f.unlink()
    return str(d)


@pytest.fixture(scope="module")
def ids_only(no_tokenizer_dir):
    return LLM(no_tokenizer_dir, skip_tokenizer_init=True, cache={"num_blocks": 64})


def test_generates_the_same_greedy_tokens_as_the_normal_engine_with_empty_text(checkpoints, ids_only):
    normal = LLM(checkpoints["llama"], cache={"num_blocks": 64})
    prompts = [[5, 6, 7, 8, 9], [100, 3, 42]]
    params = SamplingParams(max_tokens=12, temperature=0)
    want = normal.generate(prompts, params, use_tqdm=False)
    got = ids_only.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    assert all(o.outputs[0].text == "" for o in got) and any(o.outputs[0].text for o in want)
    assert ids_only.tokenizer is None
    assert ids_only.engine.eos_token_id == normal.engine.eos_token_id is not None   # from config.json


def test_text_prompts_chat_and_stop_strings_are_rejected_clearly(ids_only):
    engine = ids_only.engine
    cases = [("Once upon a time", SamplingParams(), "prompt"),
             ([{"role": "user", "content": "hi"}], SamplingParams(), "messages"),
             ([5, 6, 7], SamplingParams(stop=["x"]), "stop")]
    for prompt, params, param in cases:
        with pytest.raises(InvalidRequestError, match="token-ids-only mode.*send the prompt as a list of "
                                                      "token ids.*or turn skip_tokenizer_init off") as ei:
            engine.add_request(engine.make_request(prompt, params, req_id="r"))
        assert ei.value.param == param
        assert not engine.has_unfinished_requests()


def test_without_the_flag_the_error_names_the_files_looked_for(no_tokenizer_dir):
    with pytest.raises(ModelLoadError, match=r"no tokenizer in .*looked for tokenizer.json, tokenizer.model, "
                                             r"vocab.json, vocab.txt, \*.tiktoken.*skip_tokenizer_init: true"):
        LLM(no_tokenizer_dir, cache={"num_blocks": 64})
