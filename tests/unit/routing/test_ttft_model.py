"""The router's TTFT model: the fixed per-request overhead it fits beside the rates (TTFTModel)."""
from __future__ import annotations

import random

import pytest

from affinity_serve.app.routing import AffinityConfig
from affinity_serve.app.routing.load import MAX_OVERHEAD_S, ReplicaLoad, TTFTModel


def chat_samples(model: TTFTModel, *, rate: float, overhead: float, n: int = 400, seed: int = 0) -> None:
    """Chat turns whose history is cached: 20-120 uncached tokens each, 1-8 sequences running."""
    rng = random.Random(seed)
    for _ in range(n):
        work, running = rng.randint(20, 120), rng.randint(1, 8)
        model.observe(work, running, overhead + work / rate + running * 0.005)


def test_short_uncached_prompts_teach_the_overhead_not_a_slow_prefill_rate():
    """Before the overhead term, 30 ms per request read over ~70 tokens made the rate 2,781 tokens/s where the
    device does 8,000, and an idle replica's 8k-token prompt was predicted at 2.9 s instead of 1.0 s."""
    model = TTFTModel(AffinityConfig(prefill_tokens_per_s=10_000.0, decode_step_s=0.002))
    chat_samples(model, rate=8_000.0, overhead=0.030)
    assert model.prefill_tokens_per_s == pytest.approx(8_000.0, rel=0.05)
    assert model.decode_step_s == pytest.approx(0.005, rel=0.05)
    assert model.overhead_s == pytest.approx(0.030, rel=0.05)
    idle = ReplicaLoad("x")
    assert model.predict_many([idle], [8_000]) == [pytest.approx(0.030 + 1.0, rel=0.05)]


def test_without_an_overhead_the_fit_is_the_rates_alone():
    model = TTFTModel(AffinityConfig(prefill_tokens_per_s=10_000.0, decode_step_s=0.002))
    rng = random.Random(1)
    for _ in range(300):
        work, running = rng.randrange(0, 20_000), rng.randrange(0, 64)
        model.observe(work, running, work / 4_000.0 + running * 0.01)
    assert model.prefill_tokens_per_s == pytest.approx(4_000.0, rel=0.01)
    assert model.decode_step_s == pytest.approx(0.01, rel=0.01)
    assert model.overhead_s == pytest.approx(0.0, abs=0.02)           # of TTFTs of 0.1-5.6 s


def test_a_negative_constant_is_fitted_as_no_overhead():
    """TTFTs a little below the rates' line (a clock read late): the overhead is 0, not negative."""
    model = TTFTModel(AffinityConfig(prefill_tokens_per_s=10_000.0))
    rng = random.Random(2)
    for _ in range(300):
        work = rng.randrange(500, 20_000)
        model.observe(work, 0, work / 5_000.0 - 0.05)
    assert model.overhead_s == 0.0
    assert model.prefill_tokens_per_s == pytest.approx(5_000.0, rel=0.1)


def test_one_prompt_length_keeps_the_prior_rate_and_fits_the_constant():
    """Every prompt the same length on an idle replica cannot tell a rate from a constant: the rate keeps its
    prior and the prediction for that length is what was observed."""
    model = TTFTModel(AffinityConfig(prefill_tokens_per_s=10_000.0))
    for _ in range(50):
        model.observe(1_000, 0, 0.25)
    assert model.prefill_tokens_per_s == pytest.approx(10_000.0, rel=0.01)
    assert model.predict_many([ReplicaLoad("x")], [1_000]) == [pytest.approx(0.25, rel=0.01)]


def test_the_overhead_is_bounded():
    model = TTFTModel(AffinityConfig(prefill_tokens_per_s=10_000.0))
    for _ in range(20):
        model.observe(100, 0, 60.0)
    assert model.overhead_s == MAX_OVERHEAD_S
