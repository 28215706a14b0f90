"""Bounded waits for a model replica (scale-to-zero cold start, first output) and how a replica that goes
away mid-request reaches the client: a 503 with Retry-After, or an in-band SSE error event and [DONE]."""
import asyncio
import json
import time

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from affinity_serve.app.errors import APIError, to_api_error
from affinity_serve.app.fanout import ReplicaWait
from affinity_serve.app.http import error_response, sse


class _Replicas:
    """num_replicas() that reports `n_after` from `at_s` on (0 before)."""

    def __init__(self, at_s: float | None, n_after: int = 1):
        self.start = time.monotonic()
        self.at_s = at_s
        self.n_after = n_after

    def __call__(self) -> int:
        if self.at_s is not None and time.monotonic() - self.start >= self.at_s:
            return self.n_after
        return 0


async def _result_after(delay_s: float, value="ok"):
    await asyncio.sleep(delay_s)
    return value


async def test_no_replica_ever_is_a_503_at_the_cold_start_bound_and_the_call_is_cancelled():
    wait = ReplicaWait(first_output_s=10.0, cold_start_s=0.3, num_replicas=_Replicas(None), poll_s=0.05)
    task = asyncio.ensure_future(_result_after(60))
    t0 = time.monotonic()
    with pytest.raises(APIError) as e:
        await wait.first(task, "output")
    took = time.monotonic() - t0
    assert 0.3 <= took < 10     # at the bound, not the call's 60 s
    assert (e.value.status_code, e.value.type, e.value.code) == (503, "service_unavailable", "no_replica_running")
    assert e.value.retry_after_s is not None and "cold_start_timeout_s" in e.value.message
    await asyncio.sleep(0)
    assert task.cancelled()


async def test_a_replica_that_starts_in_time_serves_the_waiting_call():
    # Cold start 0.4 s, the replica is up at 0.2 s and answers at 0.7 s: past the cold-start bound, within
    # the first-output bound counted from when the replica came up.
    wait = ReplicaWait(first_output_s=1.0, cold_start_s=0.4, num_replicas=_Replicas(0.2), poll_s=0.05)
    assert await wait.first(_result_after(0.7), "output") == "ok"


async def test_the_first_output_clock_starts_when_a_replica_is_there():
    # first_output 0.4 s; the replica appears at 0.3 s and answers at 0.6 s (0.3 s after it appeared).
    wait = ReplicaWait(first_output_s=0.4, cold_start_s=5.0, num_replicas=_Replicas(0.3), poll_s=0.05)
    assert await wait.first(_result_after(0.6), "output") == "ok"


async def test_replicas_running_but_silent_is_a_503_at_the_first_output_bound():
    wait = ReplicaWait(first_output_s=0.3, cold_start_s=10.0, num_replicas=lambda: 2, poll_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(APIError) as e:
        await wait.first(_result_after(60), "output")
    assert 0.3 <= time.monotonic() - t0 < 10      # at the bound, not the call's 60 s
    assert (e.value.status_code, e.value.code) == (503, "replica_unavailable")


async def test_unknown_replica_count_counts_as_running_and_errors_pass_through():
    wait = ReplicaWait(first_output_s=0.2, cold_start_s=0.05, poll_s=0.05)      # num_replicas: None
    assert await wait.first(_result_after(0.1), "output") == "ok"               # past cold_start: not applied

    async def boom():
        raise ActorDiedError()
    with pytest.raises(ActorDiedError):
        await wait.first(boom(), "output")


@pytest.mark.parametrize("exc", [ActorDiedError(), ActorUnavailableError("unreachable", b"\0" * 16)])
def test_a_replica_gone_mid_request_is_a_503_with_retry_after(exc):
    err = to_api_error(exc)
    assert (err.status_code, err.type, err.code) == (503, "service_unavailable", "replica_unavailable")
    resp = error_response(err)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert set(json.loads(resp.body)["error"]) == {"message", "type", "param", "code"}


async def test_a_stream_whose_replica_dies_ends_with_an_error_event_then_done():
    async def rest():
        yield {"choices": [{"text": " b"}]}
        raise ActorDiedError()

    events = [e async for e in sse({"choices": [{"text": "a"}]}, rest(), to_api_error)]
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
    payloads = [e[len("data: "):-2] for e in events]
    assert payloads[-1] == "[DONE]"
    err = json.loads(payloads[-2])["error"]
    assert err["type"] == "service_unavailable" and err["code"] == "replica_unavailable"
    assert [json.loads(p)["choices"][0]["text"] for p in payloads[:2]] == ["a", " b"]
