"""lm-evaluation-harness's `local-completions` model against the real Serve app: a small multiple-choice
task (a YAML and a jsonl written here, offline) whose loglikelihoods must be transformers' own, not zeros."""
import json

import pytest

pytestmark = pytest.mark.slow

# target_delimiter is "": each choice carries its own leading space
DOCS = [
    {"question": "The quick brown fox jumps over the", "choices": [" lazy dog.", " moon.", " fence."], "answer": 0},
    {"question": "The capital of France is", "choices": [" Paris.", " London.", " a question."], "answer": 0},
    {"question": "All that glitters is not", "choices": [" gold.", " silver.", " power."], "answer": 0},
]
CONTEXTS = ["Once upon a time", "Knowledge is", "The scheduler hands out", "A journey of a thousand", "User:"]


@pytest.fixture
def lm_eval_offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import lm_eval
    return lm_eval


def _greedy_doc(lm, hf_reference, path) -> dict:
    """A doc whose first choice is the model's own greedy next token, so that is_greedy is true once."""
    for context in CONTEXTS:
        context_ids, _ = lm._encode_pair(context, " x")
        [token] = hf_reference(path, context_ids, 1)
        answer = lm.tokenizer.decode([token])
        if lm._encode_pair(context, answer) == (context_ids, [token]):     # it survives lm-eval's re-encoding
            return {"question": context, "choices": [answer, " moon."], "answer": 0}
    raise AssertionError("no context whose greedy next token re-encodes as itself")


def _task_dir(tmp_path, docs):
    import yaml
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = {"task": "tiny_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
            "doc_to_choice": "choices", "doc_to_target": "answer", "target_delimiter": "",
            "metric_list": [{"metric": "acc"}]}
    (tmp_path / "tiny_mc.yaml").write_text(yaml.safe_dump(task))
    return tmp_path


def test_local_completions_loglikelihoods_are_transformers_own(app_url, checkpoints, hf_reference, tmp_path,
                                                               lm_eval_offline):
    import torch
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    path = checkpoints["llama"]
    lm = LocalCompletionsAPI(base_url=f"{app_url}/v1/completions", model="tiny-llama",
                             tokenizer_backend="huggingface", tokenizer=path, tokenized_requests=True,
                             max_retries=1, timeout=60)
    docs = DOCS + [_greedy_doc(lm, hf_reference, path)]
    results = lm_eval_offline.simple_evaluate(model=lm, tasks=["tiny_mc"], log_samples=True,
                                              task_manager=TaskManager(include_path=str(_task_dir(tmp_path, docs))))
    samples = results["samples"]["tiny_mc"]
    assert len(samples) == len(docs) and 0 < results["results"]["tiny_mc"]["acc,none"] <= 1
    checked, greedy = 0, 0
    for sample in samples:
        for (context, continuation), [(loglikelihood, is_greedy)] in zip(sample["arguments"], sample["resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            ids = context_ids + continuation_ids
            ref = torch.log_softmax(hf_reference.logits(path, ids), dim=-1)
            rows = ref[len(context_ids) - 1:len(ids) - 1]                # the rows that score the continuation
            want = float(rows.gather(1, torch.tensor(continuation_ids)[:, None]).sum())
            assert loglikelihood != 0 and loglikelihood == pytest.approx(want, abs=1e-3)
            assert is_greedy == (rows.argmax(dim=-1).tolist() == continuation_ids)
            checked, greedy = checked + 1, greedy + is_greedy
    assert checked == sum(len(d["choices"]) for d in docs) and greedy >= 1
