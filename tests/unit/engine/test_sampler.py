import pytest
import torch

from affinity_serve.engine.errors import InvalidRequestError
from affinity_serve.engine.sampler import Sampler, SamplingInfo
from affinity_serve.engine.sampling_params import SamplingParams


def info(prompt=(1, 2), out=(), **kw):
    return SamplingInfo(SamplingParams(**kw), list(prompt) + list(out), len(prompt))


def logits_rows(n, vocab=50, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_degenerate_filters_equal_argmax():
    lg = logits_rows(4)
    s = Sampler(0)
    toks, _ = s(lg, [info(temperature=0), info(temperature=1.0, top_k=1), info(temperature=0.7, top_p=1e-6),
                     info(temperature=2.0, min_p=1.0)])
    assert toks == lg.argmax(-1).tolist()


def test_top_k_top_p_restrict_support():
    lg = logits_rows(1, vocab=20, seed=1)
    s = Sampler(0)
    top3 = set(lg[0].topk(3).indices.tolist())
    draws = {s(lg, [info(temperature=1.5, top_k=3)])[0][0] for _ in range(200)}
    assert draws <= top3 and len(draws) > 1
    probs = torch.softmax(lg[0], -1)
    order = probs.argsort(descending=True)
    # smallest prefix of sorted probs whose mass reaches 0.5
    k = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    allowed = set(order[:k].tolist())
    draws = {s(lg, [info(temperature=1.0, top_p=0.5)])[0][0] for _ in range(200)}
    assert draws <= allowed


def test_min_p_removes_unlikely_tokens():
    lg = torch.tensor([[5.0, 4.9, 0.0, -3.0]])
    s = Sampler(0)
    draws = {s(lg, [info(temperature=1.0, min_p=0.5)])[0][0] for _ in range(100)}
    assert draws == {0, 1}


def test_seed_is_independent_of_batch_and_position_in_it():
    lg = logits_rows(3, seed=2)
    a = Sampler(1)([lg[1:2]][0], [info(temperature=1.0, seed=7)])[0]
    b = Sampler(99)(lg, [info(temperature=1.0), info(temperature=1.0, seed=7), info(temperature=0.5)])[0][1]
    assert a == [b]
    c = Sampler(5)(lg[1:2], [info(temperature=1.0, seed=7, out=[3])])[0]      # next output index differs
    seq = [Sampler(5)(lg[1:2], [info(temperature=1.0, seed=7, out=[3] * i)])[0][0] for i in range(8)]
    assert len(set(seq)) > 1 and c[0] == seq[1]


def test_sampling_ahead_draws_what_the_next_step_draws_in_order():
    """Sampler.sample(..., pending=ids) (a decode step launched before the ids it follows reach the host): each
    row's output ends with its pending id, so penalties count it and a seeded row draws for the next output
    index. Logits after penalties and the draws equal sampling in order with the ids appended, whether the
    pending id is new to the row or already in its prompt or output."""
    lg = logits_rows(4, seed=4)
    rows = [dict(temperature=0.9, seed=11, top_p=0.95, repetition_penalty=1.3),
            dict(temperature=0, frequency_penalty=0.7, presence_penalty=0.4),
            dict(temperature=1.3, seed=3, top_k=9, repetition_penalty=0.8, frequency_penalty=-0.5),
            dict(temperature=0.8, seed=5, logit_bias={6: 2.0})]
    s = Sampler(0)
    for out in ([], [5], [5, 9, 5], [7, 30, 31, 5, 5]):
        for pending in ([5, 5, 5, 5], [9, 2, 44, 6], [1, 49, 30, 7]):         # 1, 2: in the prompt (1, 2)
            now = [info(out=out, **kw) for kw in rows]
            later = [info(out=out + [t], **kw) for kw, t in zip(rows, pending)]
            pend = torch.tensor(pending)
            assert torch.equal(s._apply_bias_and_penalties(lg, now, pend), s._apply_bias_and_penalties(lg, later))
            assert Sampler(0).sample(lg, now, pend).tolist() == Sampler(1)(lg, later)[0]
    seeded = [info(out=[5] * n, **rows[0]) for n in range(12)]
    assert len({Sampler(0).sample(lg[:1], [i]).item() for i in seeded}) > 1        # the index matters


def test_logit_bias_forces_token():
    lg = logits_rows(1, seed=3)
    worst = int(lg[0].argmin())
    toks, _ = Sampler(0)(lg, [info(temperature=0, logit_bias={worst: 100.0})])
    assert toks == [worst]


def test_penalties_follow_formulas():
    lg = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    s = Sampler(0)
    rows = s._apply_bias_and_penalties(lg, [info(prompt=[0], out=[1, 1, 2], repetition_penalty=2.0)])
    assert rows[0].tolist() == [1.0, -4.0, 0.5, 0.5]
    rows = s._apply_bias_and_penalties(lg, [info(prompt=[0], out=[1, 1, 2], presence_penalty=0.5,
                                                 frequency_penalty=0.25)])
    assert rows[0].tolist() == pytest.approx([2.0, -2.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25, 0.5])
    assert lg.tolist() == [[2.0, -2.0, 1.0, 0.5]]          # input untouched


def test_logprobs_rank_and_top():
    lg = torch.tensor([[1.0, 3.0, 2.0]])
    toks, lps = Sampler(0)(lg, [info(temperature=0, logprobs=2)])
    ref = torch.log_softmax(lg[0], -1)
    lp = lps[0]
    assert toks == [1] and lp.rank == 1 and lp.top_token_ids == [1, 2]
    assert lp.logprob == pytest.approx(float(ref[1]))
    _, lps = Sampler(0)(lg, [info(temperature=0, logit_bias={0: 50.0}, logprobs=0)])
    assert lps[0].token_id == 0 and lps[0].rank == 3 and lps[0].top_token_ids == []


@pytest.mark.parametrize("kw,param", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=0), "top_k"),
    (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"),
    (dict(logprobs=50), "logprobs"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(stop=[""]), "stop"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(temperature=float("nan")), "temperature"),
])
def test_parameter_validation(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param and param in str(e.value)


@pytest.mark.parametrize("k", [0, 4])
def test_gather_logprobs_matches_per_row(k):
    from affinity_serve.engine.sampler import gather_logprobs
    from affinity_serve.engine.types import Logprobs
    lp = torch.log_softmax(logits_rows(6, seed=9), dim=-1)
    tokens = torch.tensor([0, 5, 49, 7, 7, 13])
    got = gather_logprobs(lp, tokens, k)

    def one(row, t):                                # the definition, one row at a time
        top_v, top_i = row.topk(k) if k else (torch.zeros(0), torch.zeros(0, dtype=torch.long))
        return Logprobs(t, float(row[t]), int((row > row[t]).sum()) + 1, top_i.tolist(), top_v.tolist())
    assert got == [one(lp[r], int(tokens[r])) for r in range(6)]
    assert all(len(g.top_token_ids) == k for g in got) and gather_logprobs(lp, tokens[:0], k) == []


def test_argmax_helper_picks_what_argmax_picks_on_ties_and_nan():
    """The sampler's row argmax (max(dim).indices, faster on CPU) keeps argmax's choice: the first index of
    the maximum on ties, the NaN's index in a row with a NaN, index 0 in a constant row."""
    import torch

    from affinity_serve.engine.sampler import _argmax
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 300, generator=g)
    x[3, 10] = x[3, 20] = 50.0
    x[5] = 0.0
    x[7, 4] = float("nan")
    for t in (x, x.bfloat16()):
        assert torch.equal(_argmax(t), t.argmax(dim=-1))
    assert _argmax(x)[[3, 5, 7]].tolist() == [10, 0, 4]


def test_the_race_draws_exponentials_as_exponential_does_from_the_same_generators():
    """The CPU race's -log E: E exactly as `Tensor.exponential_` draws it (the unseeded rows in order from the
    sampler's generator, a seeded row from its (seed, output index) generator), computed faster."""
    from affinity_serve.engine.sampler import _mix
    rows = [info(temperature=1.0), info(temperature=0.5, seed=7, out=[3, 4]), info(temperature=0.0),
            info(temperature=1.0), info(temperature=2.0, seed=9)]
    sampled = [0, 1, 3, 4]
    got = Sampler(11)._exponentials(rows, sampled, 20000, ahead=1)
    gen = torch.Generator().manual_seed(11)
    unseeded = torch.empty(2, 20000).exponential_(generator=gen)
    seeded = [torch.empty(20000).exponential_(generator=torch.Generator().manual_seed(_mix(s, n + 1)))
              for s, n in ((7, 2), (9, 0))]
    want = torch.stack([unseeded[0], seeded[0], unseeded[1], seeded[1]])
    assert torch.equal(got, want)


def test_the_race_draws_from_the_tempered_distribution():
    """Draws in log space (logits / T - log E) follow softmax(logits / T), and an id whose probability
    underflows in float32 still wins where it is the only one left (a grammar may leave only such ids)."""
    lg = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]])
    s = Sampler(3)
    for temp in (0.7, 1.0):
        draws = torch.tensor([s.sample(lg, [info(temperature=temp)]).item() for _ in range(4000)])
        freq = torch.bincount(draws, minlength=5).float() / len(draws)
        assert torch.allclose(freq, torch.softmax(lg[0] / temp, -1), atol=0.03), (temp, freq)
    far = torch.tensor([[0.0, -200.0, -201.0]])
    assert float(torch.softmax(far[0], -1)[1]) == 0.0            # underflows
    allowed = torch.tensor([[False, True, True]])
    draws = {Sampler(k).sample(far, [info(temperature=1.0)], allowed=allowed).item() for k in range(200)}
    assert draws == {1, 2}                                     # by their logits: 2 at 27%


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_k=7), dict(top_k=300), dict(top_p=0.3), dict(top_p=0.9),
                                dict(top_p=0.999), dict(min_p=0.1), dict(top_k=40, top_p=0.8, min_p=0.02),
                                dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=5000)])
def test_the_filters_keep_what_sorting_the_whole_row_keeps(kw):
    """Top-k, top-p and min-p order only the prefix they need (the most likely 256 ids, then 4x as many while
    top-p's mass is short): the kept ids are those of the definition over the whole sorted row, on flat rows
    (top-p needs thousands of ids) and peaked ones (a few)."""
    from affinity_serve.engine.sampler import _kept

    def definition(probs, p):
        sorted_p, idx = probs.sort(descending=True)
        keep = torch.ones_like(sorted_p, dtype=torch.bool)
        if p.top_k:
            keep[p.top_k:] = False
        if p.top_p < 1.0:
            keep &= (sorted_p.cumsum(0) - sorted_p) < p.top_p
        if p.min_p > 0:
            keep &= sorted_p >= p.min_p * sorted_p[0]
        keep[0] = True
        mask = torch.zeros_like(keep)
        mask[idx] = keep
        return mask

    g = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=1.0, **kw)
    for scale, peak in ((1.0, 0.0), (3.0, 0.0), (3.0, 12.0)):
        x = torch.randn(4, 4000, generator=g) * scale
        x[:, :20] += peak
        for row in torch.softmax(x, -1):
            assert torch.equal(_kept(row, params), definition(row, params)), (kw, scale, peak)


def test_logit_bias_of_every_row_adds_to_its_own_row():
    """The batch's logit_bias entries go in as one indexed add: each row gets its own (ids past the vocabulary
    ignored), beside rows with penalties and rows with neither."""
    lg = logits_rows(4, vocab=10, seed=6)
    rows = [info(logit_bias={1: 2.0, 9: -1.5, 99: 5.0}), info(), info(logit_bias={1: -3.0}, presence_penalty=1.0,
                                                                    out=[4]),
            info(logit_bias={0: 0.25})]
    got = Sampler(0)._apply_bias_and_penalties(lg, rows)
    want = lg.clone()
    want[0, 1] += 2.0
    want[0, 9] -= 1.5
    want[2, 1] -= 3.0
    want[2, 4] -= 1.0
    want[3, 0] += 0.25
    assert torch.equal(got, want)
