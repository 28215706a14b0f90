"""benchmarks/autoscale_real.py's shift workloads (issue 29): the rate ramps then holds, and at half the trace
the outputs grow 4x (output-shift) or cached tenant prompts give way to unique documents (prompt-shift);
recovery is measured from the shift. No Ray cluster."""
from __future__ import annotations

import numpy as np
import pytest

from benchmarks.autoscale_real import (OUTPUT_SHIFT, SHIFT_AT, RealSpec, arrival_times, event_start_s, load_trace,
                                       shift_profile)

VOCAB = 32000


def test_shift_arrivals_ramp_then_hold_the_rate():
    duration, peak = 2000.0, 10.0
    t = arrival_times(duration, peak, seed=1, workload="output-shift")
    assert np.array_equal(t, arrival_times(duration, peak, seed=1, workload="prompt-shift"))   # same arrivals
    assert shift_profile(0.0) == pytest.approx(0.1) and shift_profile(0.1) == shift_profile(0.9) == 1.0
    steady = ((t >= 0.2 * duration) & (t < duration)).sum() / (0.8 * duration)
    assert steady == pytest.approx(peak, rel=0.05)
    assert ((t < 0.05 * duration).sum() / (0.05 * duration)) < 0.6 * peak


@pytest.mark.parametrize("workload", ["output-shift", "prompt-shift"])
def test_the_mix_changes_at_the_shift_and_only_there(workload):
    spec = RealSpec(duration_s=400, workload=workload, output_tokens=(16, 48))
    base = load_trace(RealSpec(duration_s=400, output_tokens=(16, 48), workload="output-shift"), VOCAB, 3.0)
    trace = load_trace(spec, VOCAB, 3.0)
    assert [r.arrival_s for r in trace] == [r.arrival_s for r in base]
    cut = SHIFT_AT * spec.duration_s
    assert event_start_s(spec) == cut
    before = [r for r in trace if r.arrival_s < cut]
    after = [r for r in trace if r.arrival_s >= cut]
    assert len(before) > 100 and len(after) > 100
    assert all(16 <= len(r.output_token_ids) <= 48 and r.group.startswith("tenant") for r in before)
    if workload == "output-shift":
        assert all(16 * OUTPUT_SHIFT <= len(r.output_token_ids) <= 48 * OUTPUT_SHIFT for r in after)
        assert [r.prompt_token_ids for r in after] == [r.prompt_token_ids for r in base if r.arrival_s >= cut]
    else:
        # unique documents (0.8-1.2 x doc_tokens) plus the request's own question, same outputs
        assert all(r.group == "" and 0.8 * spec.doc_tokens + 8 <= len(r.prompt_token_ids) <= 1.2 * spec.doc_tokens
                   + 32 for r in after)
        heads = {tuple(r.prompt_token_ids[:16]) for r in after}
        assert len(heads) == len(after)                         # nothing shared: every token is prefill work
        assert [len(r.output_token_ids) for r in after] == [len(r.output_token_ids) // OUTPUT_SHIFT for r in base
                                                            if r.arrival_s >= cut]
