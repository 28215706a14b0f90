"""Conditional disaggregation on a real Ray Serve (`disaggregation.local_prefill_slack_s`): 1 prefill + 1 decode
replica, the prefill replica paced to a slow device (2 s for a 100-token prompt). While one request's prompt is
being prefilled there, the ingress predicts the next one's first token sooner on the idle decode replica, which
then prefills it itself without calling the prefill pool. Both requests give transformers' greedy tokens, and
both pools end with every KV block free."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.integration.test_disagg import _ids, deployed_pd, pd_pools_empty, pd_state
from tests.integration.waiting import wait_until

pytestmark = pytest.mark.slow        # deploys its own 1P+1D app
APP = "affinity-disagg-local"


@pytest.fixture(scope="module")
def local_url(ray_serve, checkpoints):
    with deployed_pd(ray_serve, checkpoints["llama"], APP, "/disagg-local", {
            "min_remote_prefill_tokens": 12, "local_prefill_slack_s": 0.0, "transfer_timeout_s": 20.0,
            "prefill": {"num_replicas": 1, "engine": {
                "scheduler": {"max_num_batched_tokens": 64},
                "pace": {"enabled": True, "step_base_s": 0.01, "prefill_per_token_s": 0.02}}}}) as url:
        yield url


def _complete(url: str, prompt: list[int], out: dict, key: str) -> None:
    with httpx.Client(timeout=60) as c:
        r = c.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0,
                                                   "ignore_eos": True, "return_token_ids": True})
    out[key] = r


def test_a_request_behind_a_slow_prefill_is_prefilled_on_the_decode_replica(local_url, checkpoints, hf_reference):
    path = checkpoints["llama"]
    first, second = _ids(100, 901), _ids(60, 902)
    before = pd_state(APP, "LLMReplica")["disaggregation"]
    out: dict[str, httpx.Response] = {}
    t = threading.Thread(target=_complete, args=(local_url, first, out, "first"))
    t.start()
    time.sleep(0.7)                     # the first prompt is in the paced prefill replica's steps (about 2 s)
    _complete(local_url, second, out, "second")
    t.join(timeout=60)
    for key, prompt in (("first", first), ("second", second)):
        assert out[key].status_code == 200, out[key].text
        assert out[key].json()["choices"][0]["token_ids"] == hf_reference(path, prompt, 6), key
    after = pd_state(APP, "LLMReplica")["disaggregation"]
    assert after["remote"] - before["remote"] == 1                 # the first, by the prefill pool
    assert after["local_backlog"] - before["local_backlog"] == 1   # the second, here
    assert out["second"].elapsed.total_seconds() < out["first"].elapsed.total_seconds()
    wait_until(lambda: pd_pools_empty(APP), 30, "both pools to free every block")
