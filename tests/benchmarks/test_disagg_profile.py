"""benchmarks/disagg.py's device profiles: the pace costs follow from the stated hardware and model figures,
one dilation factor scales all of them (and the arrival rate), and the old hand-set flags keep working."""
from __future__ import annotations

import pytest

from benchmarks.disagg import PROFILES, DeviceProfile, paced_costs, parse_args, unified_name, verdicts

H100 = PROFILES["h100-llama8b"]


def test_llama_3_1_8b_shapes_give_its_published_size_and_kv_bytes():
    assert H100.weight_bytes == 2 * 8_030_261_248            # Llama-3.1-8B's parameter count, bf16
    assert H100.kv_bytes_per_token == 131_072                # 32 layers x K,V x 8 heads x 128 x 2 bytes
    assert H100.matmul_params == 6_979_321_856               # without embedding and LM head


def test_h100_costs_follow_from_bandwidth_flops_and_shapes():
    c = paced_costs(H100, mean_prompt_tokens=5024, time_dilation=1.0)
    bw = 3.35e12 * 0.9
    assert c.step_base_s == pytest.approx(16_060_522_496 / bw + 0.58e-3)
    assert c.step_base_s == pytest.approx(5.91e-3, rel=1e-3)
    assert c.decode_per_context_token_s == pytest.approx(131_072 / bw)            # ~4.3e-8 s
    flops = 2 * 6_979_321_856 + 4 * 32 * 32 * 128 * 2512                          # ~15.3 GFLOP a prompt token
    assert c.prefill_per_token_s == pytest.approx(flops / (0.5 * 989.4e12))      # ~31 us
    assert c.transfer_per_token_s == pytest.approx(131_072 / 40e9)                # 400 Gb/s NIC at 0.8
    # the earlier hand-set device (40 ms + 0.4 ms/prompt token + 8e-7 s/context token) charged, relative to
    # its step, about 1.9x this prefill and 2.7x this context cost
    assert 0.4e-3 / 0.04 / (c.prefill_per_token_s / c.step_base_s) == pytest.approx(1.9, abs=0.05)
    assert 8e-7 / 0.04 / (c.decode_per_context_token_s / c.step_base_s) == pytest.approx(2.7, abs=0.05)


def test_round_numbers_profile_gives_exact_costs():
    p = DeviceProfile(name="toy", hbm_bytes_per_s=1e9, bandwidth_fraction=0.5, dense_bf16_flop_per_s=1e12,
                      mfu=0.25, step_overhead_s=0.001, link_bytes_per_s=1e6, num_layers=1, hidden_size=4,
                      num_heads=2, num_kv_heads=1, head_dim=2, intermediate_size=8, vocab_size=10)
    # matmul: q,o 4x4 each; k,v 4x2 each; MLP 3 x 4x8 -> 16+16+8+8+96 = 144; + 2 x 10 x 4 + norms 2x4+4
    assert p.matmul_params == 144 and p.weight_bytes == (144 + 80 + 12) * 2 and p.kv_bytes_per_token == 8
    c = paced_costs(p, mean_prompt_tokens=100, time_dilation=3)
    assert c.step_base_s == pytest.approx(3 * (472 / 0.5e9 + 0.001))
    assert c.decode_per_context_token_s == pytest.approx(3 * 8 / 0.5e9)
    assert c.prefill_per_token_s == pytest.approx(3 * (2 * 144 + 4 * 2 * 2 * 50) / 0.25e12)
    assert c.transfer_per_token_s == pytest.approx(3 * 8 / 1e6)


def test_one_dilation_scales_every_cost():
    one, ten = paced_costs(H100, 5024, 1.0), paced_costs(H100, 5024, 10.0)
    for f in ("step_base_s", "prefill_per_token_s", "decode_per_context_token_s", "transfer_per_token_s"):
        assert getattr(ten, f) == pytest.approx(10 * getattr(one, f))
    with pytest.raises(ValueError, match="time_dilation must be >= 1"):
        paced_costs(H100, 5024, 0.5)


def test_profile_flag_fills_the_costs_and_divides_the_rate():
    a = parse_args(["--device-profile", "h100-llama8b", "--time-dilation", "8", "--rate", "6.4",
                    "--min-prompt", "2048", "--max-prompt", "8000"])
    c = paced_costs(H100, 5024, 8)
    assert (a.step_base_s, a.prefill_per_token_s, a.decode_per_context_token_s, a.transfer_per_token_s) == (
        c.step_base_s, c.prefill_per_token_s, c.decode_per_context_token_s, c.transfer_per_token_s)
    assert a.wall_rate == pytest.approx(0.8) and a.rate == 6.4
    assert parse_args(["--device-profile", "h100-llama8b"]).time_dilation == 10.0


def test_hand_set_costs_keep_their_old_meaning():
    a = parse_args(["--rate", "0.5", "--step-base-s", "0.04", "--prefill-per-token-s", "0.0004",
                    "--decode-per-context-token-s", "8e-7"])
    assert (a.step_base_s, a.prefill_per_token_s, a.decode_per_context_token_s) == (0.04, 0.0004, 8e-7)
    assert a.wall_rate == 0.5 and a.time_dilation == 1.0 and a.transfer_per_token_s == 0.0
    d = parse_args([])
    assert (d.step_base_s, d.prefill_per_token_s, d.decode_per_context_token_s, d.rate) == (0.010, 1e-4, 0.0, 1.2)


@pytest.mark.parametrize("argv, says", [
    (["--device-profile", "h100-llama8b", "--step-base-s", "0.04"], "drop --step-base-s"),
    (["--time-dilation", "4"], "applies to --device-profile"),
    (["--device-profile", "h100-llama8b", "--time-dilation", "0.5"], "must be >= 1"),
])
def test_conflicting_flags_say_what_to_change(argv, says, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert says in capsys.readouterr().err


def test_target_is_met_only_against_every_unified_budget():
    def row(name, ttft, tpot, failed=0):
        return {"config": name, "ttft_p99_s": ttft, "tpot_p99_s": tpot, "failed": failed}
    rows = [row("unified x4 b512", 2.0, 0.10), row("unified x4 b2048", 1.0, 0.20), row("P/D 2:2", 1.1, 0.05),
            row("P/D 1:3", 1.1, 0.05, failed=1)]
    v = {(x["pd"], x["unified"]): x["met"] for x in verdicts(rows)}
    assert v == {("P/D 2:2", "unified x4 b512"): True, ("P/D 2:2", "unified x4 b2048"): True,
                 ("P/D 1:3", "unified x4 b512"): False, ("P/D 1:3", "unified x4 b2048"): False}
    rows[2] = row("P/D 2:2", 1.3, 0.05)    # TTFT 1.3x the b2048 row's
    v = {(x["pd"], x["unified"]): x["met"] for x in verdicts(rows)}
    assert v[("P/D 2:2", "unified x4 b512")] and not v[("P/D 2:2", "unified x4 b2048")]


def test_a_unified_budget_listed_twice_runs_twice_under_distinct_names():
    budgets = [512, 2048, 2048, 512]
    names = [unified_name(8, budgets, i) for i in range(len(budgets))]
    assert names == ["unified x8 b512", "unified x8 b2048", "unified x8 b2048 #2", "unified x8 b512 #2"]
    assert unified_name(4, [2048], 0) == "unified x4"
    assert parse_args(["--unified-budgets", "2048,2048"]).unified_budgets == "2048,2048"


def test_a_backed_up_prefill_pool_spills_prefills_onto_the_decode_engines(tmp_path):
    """--spill-tokens (conditional disaggregation): with one prefill engine paced slow and every request
    arriving at once, requests past the threshold's queue are prefilled on a decode engine, and every
    request still finishes with all its tokens; without a threshold none is."""
    from affinity_serve.engine.demo import write_demo_model
    from benchmarks.disagg import run

    model = str(tmp_path / "m")
    write_demo_model(model, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                     max_position_embeddings=1024, seed=1)
    args = parse_args(["--num-engines", "3", "--num-requests", "6", "--rate", "1000", "--min-prompt", "200",
                       "--max-prompt", "300", "--max-tokens", "3", "--num-blocks", "400", "--drain-s", "60",
                       "--step-base-s", "0.002", "--prefill-per-token-s", "0.0005"])
    for spill, spilled in ((250, True), (0, False)):
        reqs, stats, _ = run(model, args, 1, spill_tokens=spill)
        assert all(r.done is not None and not r.failed and len(r.token_times) == 3 for r in reqs)
        assert (stats["spilled"] > 0) is spilled and stats["spilled"] < 6
        assert stats["loads_ok"] == 6 - stats["spilled"]


@pytest.mark.parametrize("value", ["x", "-1", "8192,-5"])
def test_spill_tokens_that_are_not_token_counts_are_refused(value, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--spill-tokens", value])
    assert "--spill-tokens" in capsys.readouterr().err
    assert parse_args(["--spill-tokens", "0,8192"]).spill_list == [0, 8192]
    assert parse_args([]).spill_list == [0]
