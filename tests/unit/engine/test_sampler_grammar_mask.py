"""Greedy sampling under a grammar mask on the host (issue 27): the raw argmax where the grammar allows it, the
mask's pass only for the other rows (or all rows for a while when most needed it), always the tokens that
masking first gives."""
from __future__ import annotations

import pytest
import torch

from affinity_serve.engine.sampler import _MASK_ALL_STEPS, Sampler, SamplingInfo
from affinity_serve.engine.sampling_params import SamplingParams


def _reference(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return torch.where(allowed, logits, float("-inf")).argmax(-1)


def _infos(n: int, **kw) -> list[SamplingInfo]:
    return [SamplingInfo(SamplingParams(temperature=0.0, **kw), [1, 2, 3], 3) for _ in range(n)]


def test_masked_greedy_equals_masking_first_whatever_share_of_rows_it_forbids():
    g = torch.Generator().manual_seed(0)
    for step in range(60):
        sampler = Sampler()                # each step from the raw argmax (see the test below for the switch)
        logits = torch.randn(16, 500, generator=g)
        logits[:, 7] = logits[:, 9] = logits.max() + 1        # ties: the first allowed maximum wins
        allowed = torch.rand(16, 500, generator=g) < (0.9 if step % 3 else 0.02)
        allowed[:, 0] = True
        raw = logits.argmax(-1)
        allowed[: step % 17, :][torch.arange(step % 17), raw[: step % 17]] = False   # some rows' argmax banned
        got = sampler.sample(logits.clone(), _infos(16), allowed=allowed)
        assert torch.equal(got, _reference(logits, allowed)), step


def test_bias_and_penalties_apply_as_if_masked_first():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=g)
    allowed = torch.rand(4, 300, generator=g) < 0.3
    infos = [SamplingInfo(SamplingParams(temperature=0.0, logit_bias={int(allowed[0].nonzero()[-1]): 50.0},
                                         repetition_penalty=1.3, frequency_penalty=0.5), [5, 6, 6, 7], 2)
             for _ in range(4)]
    ref_sampler, sampler = Sampler(), Sampler()
    masked_first = ref_sampler._apply_bias_and_penalties(torch.where(allowed, logits, float("-inf")), infos)
    assert torch.equal(sampler.sample(logits.clone(), infos, allowed=allowed), masked_first.argmax(-1))


def test_while_most_rows_need_the_mask_all_rows_are_masked_for_1_2_4_then_16_steps():
    sampler = Sampler()
    logits = torch.zeros(4, 64)
    logits[:, 5] = 1.0
    banned = torch.ones(4, 64, dtype=torch.bool)
    banned[:, 5] = False                                     # every row's argmax banned
    fine = torch.ones(4, 64, dtype=torch.bool)
    for backoff in [1, 2, 4, 8, 16, 16]:
        assert sampler.sample(logits, _infos(4), allowed=banned).tolist() == [0] * 4
        assert sampler._mask_all_steps == backoff
        for _ in range(backoff):                             # masked in full: no look at the raw argmax
            assert sampler.sample(logits, _infos(4), allowed=banned).tolist() == [0] * 4
    assert backoff == _MASK_ALL_STEPS and sampler._mask_all_steps == 0
    assert sampler.sample(logits, _infos(4), allowed=fine).tolist() == [5] * 4      # allowed again: starts over
    assert sampler.sample(logits, _infos(4), allowed=banned).tolist() == [0] * 4
    assert sampler._mask_all_steps == 1


class _Check:
    """A RowCheck over a boolean mask, counting what the sampler asked."""

    def __init__(self, allowed: torch.Tensor):
        self.allowed = allowed
        self.asked = 0
        self.filled: list[list[int]] = []

    def allows(self, rows, token_ids, keep=False):
        self.asked += len(rows)
        return [bool(self.allowed[i, t]) for i, t in zip(rows, token_ids)]

    def release(self):
        """This double keeps no token ahead, so there is nothing to undo."""

    def fill(self, rows):
        from affinity_serve.engine.structured_output.manager import _pack_bits
        self.filled.append(list(rows))
        return torch.stack([_pack_bits(self.allowed[i]) for i in rows])


@pytest.mark.parametrize("tries", [0, 1, 4])
def test_a_token_mask_asks_the_banned_rows_next_argmax_and_fills_only_what_asking_does_not_settle(
        tries, monkeypatch):
    """A host TokenMask: each row's argmax is asked of its matcher; a banned row's next argmax (value down,
    then index up, ties included) is asked up to _ASK_TRIES times, and only the rows still unsettled are
    filled (alone); rows without a grammar are never asked; the tokens are always those of masking first, and
    when most rows are banned the whole mask is filled."""
    import affinity_serve.engine.sampler as sampler_module
    from affinity_serve.engine.structured_output.grammar import GrammarBitmask, TokenMask
    from affinity_serve.engine.structured_output.manager import _pack_bits
    monkeypatch.setattr(sampler_module, "_ASK_TRIES", tries)
    g = torch.Generator().manual_seed(2)
    for step in range(40):
        vocab = 300 + step
        logits = torch.randn(12, vocab, generator=g)
        logits[:, 7] = logits[:, 9] = logits.max() + 1          # ties: the first allowed maximum wins
        density = 0.9 if step % 4 else 0.05
        if step % 8 == 3:
            density = 0.01                                      # banned rows that asking does not settle
        allowed = torch.rand(12, vocab, generator=g) < density
        allowed[:, 3] = True
        raw = logits.argmax(-1)
        num_banned = step % 5 if step % 4 else 9
        allowed[torch.arange(12), raw] = torch.arange(12) >= num_banned     # the first rows' argmax banned
        rows = [None if k % 6 == 5 else k for k in range(12)]     # rows 5 and 11: no grammar
        expected = torch.where(allowed, logits, float("-inf"))
        expected[[5, 11]] = logits[[5, 11]]
        check = _Check(allowed)
        bitmask = GrammarBitmask([f"r{k}" for k in range(12)],
                                 lambda: torch.stack([_pack_bits(allowed[i]) for i in range(12)]), check=check)
        got = Sampler().sample(logits.clone(), _infos(12), allowed=TokenMask(bitmask, rows, vocab))
        assert torch.equal(got, expected.argmax(-1)), (step, tries)
        banned = [k for k in range(num_banned) if k != 5]
        if step % 4:                                       # most argmaxes allowed: asked, a few rows filled
            assert check.asked >= 10
            filled = [r for f in check.filled for r in f]
            assert set(filled) <= set(banned) and len(check.filled) <= 1
            if tries == 0:
                assert filled == banned
            if density == 0.9 and tries == 4:
                assert len(filled) < len(banned) or not banned     # most settled by asking
        else:                                              # most banned: the whole mask, filled once
            assert bitmask._packed is not None


def _mixed_infos(n: int) -> list[SamplingInfo]:
    """Greedy, seeded and unseeded temperature rows, biased and penalised ones, and rows with top-k, top-p and
    min-p (which read the masked distribution, so are masked first)."""
    kinds = [dict(temperature=0.0), dict(temperature=1.0, seed=5), dict(temperature=0.7),
             dict(temperature=1.3, seed=2, logit_bias={4: 3.0}, repetition_penalty=1.2),
             dict(temperature=1.0, top_k=5, seed=1), dict(temperature=0.9, top_p=0.8),
             dict(temperature=1.0, min_p=0.2, seed=8), dict(temperature=1.0, seed=9, frequency_penalty=0.5)]
    return [SamplingInfo(SamplingParams(**kinds[k % len(kinds)]), [1, 2, 3, 3, k], 3) for k in range(n)]


@pytest.mark.parametrize("lazy", [False, True], ids=["tensor", "token_mask"])
def test_sampled_rows_under_a_grammar_draw_what_masking_first_draws(lazy):
    """Sampled rows (temperature alone, seeded or not) take their unmasked race winner where the grammar
    allows it and otherwise search on: the tokens are exactly those of masking first, whatever share of
    rows the grammar bans; rows with top-k, top-p or min-p are filled (alone) before their filters run."""
    from affinity_serve.engine.structured_output.grammar import GrammarBitmask, TokenMask
    from affinity_serve.engine.structured_output.manager import _pack_bits
    g = torch.Generator().manual_seed(3)
    infos = _mixed_infos(16)
    for step in range(40):
        vocab = 400 + step
        logits = torch.randn(16, vocab, generator=g) * 2
        density = (0.9, 0.3, 0.02)[step % 3]
        allowed = torch.rand(16, vocab, generator=g) < density
        allowed[:, 3] = True
        sampler, ref = Sampler(step), Sampler(step)          # unseeded rows: the same generator stream
        want = ref.sample(torch.where(allowed, logits, float("-inf")), infos)
        if lazy:
            check = _Check(allowed)
            mask = TokenMask(GrammarBitmask([f"r{k}" for k in range(16)],
                                            lambda: torch.stack([_pack_bits(allowed[i]) for i in range(16)]),
                                            check=check), list(range(16)), vocab)
        else:
            mask = allowed
        got = sampler.sample(logits.clone(), infos, allowed=mask)
        assert torch.equal(got, want), step
        assert allowed[torch.arange(16), got].all()
        if lazy and density == 0.9:
            filtered = [k for k, i in enumerate(infos) if i.params.top_k or i.params.top_p < 1 or i.params.min_p]
            assert check.asked >= 16 and check.filled[0] == filtered      # the filtered rows, filled first


def test_a_padded_vocabulary_searches_constrained_rows_below_the_tokenizers_ids():
    """Ids past the tokenizer (a padded vocabulary's; `TokenMask.num_ids`) are never allowed, so a constrained
    row's winner is taken among the others (a random model's raw winner is mostly past them); a row without
    a grammar still takes any id, also where most rows are banned and the whole mask is filled (only its
    tokenizer's ids unpacked). The tokens equal masking first, greedy and sampled."""
    from affinity_serve.engine.structured_output.grammar import GrammarBitmask, TokenMask
    from affinity_serve.engine.structured_output.manager import _pack_bits
    g = torch.Generator().manual_seed(4)
    vocab, num_ids = 600, 90
    infos = _infos(4) + [SamplingInfo(SamplingParams(temperature=1.0, seed=k), [1, 2], 2) for k in range(4)]
    for step in range(20):
        logits = torch.randn(8, vocab, generator=g)
        logits[:, num_ids:] += 2.0                          # the raw winners lie past the tokenizer's ids
        density = 0.8 if step % 2 else 0.0                 # most rows banned: the whole mask, its prefix
        if not density:
            logits[:, 0] -= 10.0                            # the one allowed id is never a raw winner
        allowed = torch.rand(8, vocab, generator=g) < density
        allowed[:, num_ids:] = False
        allowed[:, 0] = True
        rows = [None if k in (3, 7) else k for k in range(8)]
        allowed[[3, 7]] = True
        want = Sampler(step).sample(torch.where(allowed, logits, float("-inf")), infos)
        check = _Check(allowed)
        check.num_ids = num_ids
        bitmask = GrammarBitmask([f"r{k}" for k in range(8)],
                                 lambda: torch.stack([_pack_bits(allowed[i]) for i in range(8)]), check=check)
        mask = TokenMask(bitmask, rows, vocab)
        assert mask.num_ids == num_ids and mask.rows_without_grammar() == [3, 7]
        got = Sampler(step).sample(logits.clone(), infos, allowed=mask)
        assert torch.equal(got, want), step
        assert (got[[3, 7]] >= num_ids).all()
        assert (bitmask._packed is None) == (density == 0.8), step    # asked, or filled whole
