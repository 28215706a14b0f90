"""The scale-down band sized by the measured forecast error (`forecast_error_band`) and the down rule
following a falling trend (`trend_scale_in`), autoscale/policy.py: decisions that differ because of them."""
from __future__ import annotations

import numpy as np
import pytest

from affinity_serve.autoscale.policy import PolicyState, decide, downscale_band
from tests.unit.autoscale.test_policy import CFG, busy

# a 10 s lead (the start-up), the trend over 30 s, errors over 60 s; downscale 0.5 / target 0.8: widest 1.6
BAND = CFG.model_copy(update=dict(trend_lead_s=10.0, trend_window_s=30.0, measured_startup=False,
                                  forecast_error_band=True, forecast_error_window_s=60.0,
                                  downscale_band_floor=0.1, downscale_delay_s=0.0))


def run(units_at, cfg, seconds: float, current: int = 8):
    """Decisions every 0.5 s on `units_at(t)` units of decode load (10 sequences a unit), `current` held."""
    s, d = PolicyState(), None
    for t in np.arange(0.0, seconds, 0.5):
        d = decide([busy(units_at(float(t)) * 10 / current)] * current, current, float(t), s, cfg)
        s = d.state
    return d


def test_a_well_forecast_load_narrows_the_band_and_lets_the_fleet_go_down():
    steady = run(lambda t: 4.0, BAND, 90.0)
    assert downscale_band(steady.state, BAND) == pytest.approx(1.1)         # errors of 1.0: the floor
    off = BAND.model_copy(update=dict(forecast_error_band=False))
    fixed = run(lambda t: 4.0, off, 90.0)
    assert downscale_band(fixed.state, off) == pytest.approx(1.6)
    assert fixed.state.forecast_errors == ()                               # nothing tracked when off
    # 4 units: the fixed band keeps ceil(4 x 1.6 / 0.8) = 8; the measured one allows ceil(4 x 1.1 / 0.8) = 6
    assert (fixed.down_target, fixed.target_replicas) == (8, 8)
    assert (steady.down_target, steady.target_replicas) == (6, 6)


def test_a_load_that_outran_its_forecast_keeps_the_band_as_wide_as_the_miss():
    # 3 units, then 5 from t=60 (a step no trend foresaw). The projections made in the 10 s before it saw a
    # mean load up to 5 / 3 of theirs; the 90th percentile of the window's errors is 9/7 (2 / 7 of the way)
    d = run(lambda t: 3.0 if t < 60 else 5.0, BAND, 100.0)
    assert downscale_band(d.state, BAND) == pytest.approx(9 / 7, rel=0.01)
    assert d.down_target == 9                                              # ceil(5 x 9/7 / 0.8); floor: 7
    # once the miss is older than the window the band narrows again
    later = run(lambda t: 3.0 if t < 60 else 5.0, BAND, 180.0)
    assert downscale_band(later.state, BAND) == pytest.approx(1.1)
    assert later.down_target == 7


def test_the_widest_band_holds_until_the_errors_span_half_the_window():
    young = run(lambda t: 4.0, BAND, 35.0)              # errors from t=10 to 35: 25 s < 30 s
    assert downscale_band(young.state, BAND) == pytest.approx(1.6)
    assert young.down_target == 8


def test_a_falling_trend_sizes_the_down_rule_for_the_load_a_start_up_ahead():
    cfg = BAND.model_copy(update=dict(forecast_error_band=False))
    falling = lambda t: max(0.5, 5.0 - 0.05 * t)       # noqa: E731  -0.05 units/s: 0.5 less in 10 s
    without = run(falling, cfg.model_copy(update=dict(trend_scale_in=False)), 40.0)
    with_it = run(falling, cfg, 40.0)                   # the default
    assert with_it.load.falling_units == pytest.approx(-0.5, rel=1e-3)
    assert without.load.falling_units == 0.0
    # 3.05 units now: ceil(3.05 x 1.6 / 0.8) = 7 without, ceil(2.55 x 1.6 / 0.8) = 6 with
    assert (without.down_target, with_it.down_target) == (7, 6)
    assert with_it.up_target == without.up_target                          # the up rule does not follow it


def test_on_a_falling_trend_the_fleet_still_keeps_its_windows_largest_down_target():
    """The load falls 0.05 units/s; the down condition has held for the 30 s window. The falling trend lowers
    today's down target, but the fleet stays at the largest of the window: following today's target instead
    (measured) scaled the base trace in below its post-burst plateau (attainment 0.9988 -> 0.9900, recovery
    0 -> 79 s)."""
    cfg = BAND.model_copy(update=dict(forecast_error_band=False, downscale_delay_s=30.0))
    falling = lambda t: max(0.5, 5.0 - 0.05 * t)       # noqa: E731
    without = run(falling, cfg.model_copy(update=dict(trend_scale_in=False)), 70.0)
    with_it = run(falling, cfg, 70.0)
    # 1.525 units at t=69.5: today's down target ceil(1.525 x 2) = 4 without, ceil(1.025 x 2) = 3 with
    assert (without.down_target, with_it.down_target) == (4, 3)
    # the window's largest: 7 without (t=39.5, 3.5 units), 6 with (3.5 - 0.5 units)
    assert (without.target_replicas, with_it.target_replicas) == (7, 6)


def test_a_steady_load_has_no_falling_trend_and_keeps_the_window():
    d = run(lambda t: 4.0, BAND.model_copy(update=dict(forecast_error_band=False)), 60.0)
    assert d.load.falling_units == 0.0
