"""A copy of a request's sampling params keeps which fields it left unset: the engine fills those from the model's
generation_config.json (`with_defaults`). `dataclasses.replace` recomputed them from the neutral values already
filled in, so the P/D prefill call's copy and a structured-output request's copy sampled with neutral values
instead of the model's (a reviewer's finding)."""
from __future__ import annotations

import dataclasses

from affinity_serve.app.disagg import prefill_sampling_params
from affinity_serve.engine import SamplingParams

DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.1}


def test_a_copy_keeps_the_unset_fields_and_takes_the_models_defaults():
    p = SamplingParams(max_tokens=8, min_tokens=3)
    assert {"temperature", "top_p", "repetition_penalty"} <= p.unset_fields
    assert dataclasses.replace(p, max_tokens=4).with_defaults(DEFAULTS).temperature == 1.0   # the old way: lost
    one = prefill_sampling_params(p)
    assert (one.max_tokens, one.min_tokens) == (1, 1) and one.unset_fields == p.unset_fields
    filled = one.with_defaults(DEFAULTS)
    assert (filled.temperature, filled.top_p, filled.repetition_penalty) == (0.6, 0.95, 1.1)
    # a field the copy sets is no longer unset; fields the request set stay its own
    q = SamplingParams(max_tokens=8, temperature=0.0).copy_with(top_p=0.5)
    assert "top_p" not in q.unset_fields and "temperature" not in q.unset_fields
    assert q.with_defaults(DEFAULTS).temperature == 0.0 and q.with_defaults(DEFAULTS).top_p == 0.5
    assert q.with_defaults(DEFAULTS).repetition_penalty == 1.1
