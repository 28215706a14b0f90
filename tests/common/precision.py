"""How close a half-precision engine run is to transformers in float32: the one measure the CPU bf16 test
and the CUDA bf16/fp16 tests share (docs/engine.md, "Precision", states the tolerances).

Teacher-forced: the float32 reference scores the engine's own continuation, so one early divergence does
not turn every later token into a mismatch. For each generated token: whether it is the reference's top-1
there, and |engine logprob - reference logprob| of that token.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

#: the stated tolerances: over >= 200 generated tokens of the scenario below
MIN_TOP1_AGREEMENT = 0.95
MAX_MEAN_ABS_LOGPROB_DIFF = 0.05
MAX_ABS_LOGPROB_DIFF = 0.5


@dataclass
class Agreement:
    num_tokens: int
    top1: float
    mean_abs_diff: float
    max_abs_diff: float

    def check(self) -> None:
        assert self.num_tokens >= 200, self
        assert self.top1 >= MIN_TOP1_AGREEMENT, self
        assert self.mean_abs_diff <= MAX_MEAN_ABS_LOGPROB_DIFF, self
        assert self.max_abs_diff <= MAX_ABS_LOGPROB_DIFF, self


def scenario_prompts(seed: int = 0) -> list[list[int]]:
    """Mixed lengths (1-300 tokens), four prompts sharing a 96-token prefix (prefix hits; cascade decode
    once they decode together), and a long one that a small token budget chunks."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 700) for _ in range(96)]
    own = [[rng.randrange(10, 700) for _ in range(rng.randint(1, 60))] for _ in range(6)]
    shared = [prefix + [rng.randrange(10, 700) for _ in range(rng.randint(1, 8))] for _ in range(4)]
    return own + shared + [[rng.randrange(10, 700) for _ in range(300)]]


def agreement(llm, hf_logits, path: str, prompts: list[list[int]], max_tokens: int = 24) -> Agreement:
    from affinity_serve.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    hits, diffs = [], []
    for ids, out in zip(prompts, outs):
        seq = out.outputs[0]
        ref = torch.log_softmax(hf_logits(path, ids + seq.token_ids), dim=-1)
        for i, (tok, lp) in enumerate(zip(seq.token_ids, seq.logprobs)):
            row = ref[len(ids) - 1 + i]
            hits.append(int(row.argmax()) == tok)
            diffs.append(abs(lp.logprob - float(row[tok])))
    return Agreement(len(hits), sum(hits) / len(hits), sum(diffs) / len(diffs), max(diffs))
