"""LLM: the offline batch API (`LLM(model=PATH).generate(prompts, params)`)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from affinity_serve.engine.config import EngineConfig
from affinity_serve.engine.llm_engine import LLMEngine, Prompt
from affinity_serve.engine.outputs import CompletionOutput, RequestOutput
from affinity_serve.engine.sampling_params import SamplingParams


class LLM:
    """Generate for a batch of prompts with continuous batching, then return results in input order.

    Keyword arguments are EngineConfig fields (`cache=...`, `scheduler=...` take dicts or models).
    """

    def __init__(self, model: str, **engine_config: Any):
        self.engine = LLMEngine.from_config(EngineConfig(model=str(model), **engine_config))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, *, use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and (
                isinstance(prompts[0], int) or (isinstance(prompts[0], dict) and "role" in prompts[0]))):
            prompts = [prompts]           # one text, token-id list, conversation or vLLM prompt dict
        prompts = [_from_prompt_dict(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, params in zip(prompts, params_list):
            request = self.engine.make_request(prompt, params, req_id=f"offline-{next(self._ids)}")
            self.engine.add_request(request)
            rid = request.req_id
            results[rid] = RequestOutput(rid, request.prompt_token_ids, [CompletionOutput(i) for i in range(params.n)])
            order.append(rid)
        bar = _progress(len(order), use_tqdm)
        pending = set(order)
        while pending:
            step = self.engine.step()
            for d in step.deltas:
                if d.req_id in results:
                    results[d.req_id].add(d)
            done = step.finished_req_ids & pending
            pending -= done
            if bar is not None and done:
                bar.update(len(done))
        if bar is not None:
            bar.close()
        return [results[r] for r in order]

    def chat(self, conversations: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             *, use_tqdm: bool = True) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate(list(conversations), sampling_params, use_tqdm=use_tqdm)


def _from_prompt_dict(prompt: Any) -> Any:
    """vLLM's prompt dicts, `{"prompt": text}` (TextPrompt) and `{"prompt_token_ids": ids}` (TokensPrompt), as
    this engine's prompt; anything else as given."""
    if not isinstance(prompt, dict):
        return prompt
    keys = sorted(prompt)
    if keys == ["prompt"]:
        return prompt["prompt"]
    if keys == ["prompt_token_ids"]:
        return list(prompt["prompt_token_ids"])
    raise ValueError(f"a prompt dict takes exactly 'prompt' (text) or 'prompt_token_ids' (token ids), as vLLM's "
                     f"TextPrompt and TokensPrompt; got keys {keys} (a conversation is a list of "
                     "{'role', 'content'} messages)")


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="generating", unit="req", dynamic_ncols=True)
