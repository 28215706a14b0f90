"""Sampler: logits -> token ids (+ log-probabilities) for a batch with per-request parameters.

Order: grammar mask (structured output) -> logit_bias -> penalties -> min_tokens mask -> (greedy argmax |
temperature -> top-k -> top-p -> min-p -> draw). The draw is an exponential race, argmax(p / E) with E ~ Exp(1)
per id, taken in log space (see Sampler._race_scores). The min_tokens mask sets every EOS id (unless ignore_eos) and
stop token id to -inf while a request has fewer than min_tokens output tokens, so it cannot stop early (vLLM's
MinTokensLogitsProcessor).
Log-probabilities are those of the raw model distribution (log_softmax of the unprocessed logits).
A seeded request draws from a generator seeded with (seed, output index), so its tokens do not
depend on what else is in the batch, nor on preemption and resumption.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from affinity_serve.engine.sampling_params import SamplingParams
from affinity_serve.engine.structured_output.grammar import TokenMask
from affinity_serve.engine.types import Logprobs

_SEED_MIX = 0x9E3779B97F4A7C15
#: see Sampler._masked_argmax
_MASK_ALL_STEPS = 16
#: see _next_allowed
_ASK_TRIES = 4
#: see _neg_log_
_TINY = float(np.finfo(np.float32).tiny)


@dataclass(slots=True)
class SamplingInfo:
    """One sampling row: its parameters and its tokens so far (sliced only when penalties need them)."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def min_tokens_blocked_ids(self, ahead: int = 0) -> list[int]:
        """The ids masked this step: EOS (unless ignore_eos) and stop token ids while fewer than min_tokens
        are out (`ahead`: outputs sampled but not in token_ids yet)."""
        p = self.params
        if p.min_tokens == 0 or self.num_output_tokens + ahead >= p.min_tokens:
            return []
        ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            ids.update(p.eos_token_ids)
        return sorted(ids)


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._seeded = torch.Generator(device=self.device)
        #: constrained steps left to mask in full before trying the raw argmax again, and how many the
        #: next step that finds most argmaxes banned sets (doubling up to _MASK_ALL_STEPS; see _masked_argmax)
        self._mask_all_steps = 0
        self._mask_all_backoff = 1

    def __call__(self, logits: torch.Tensor, infos: list[SamplingInfo],
                 allowed: torch.Tensor | TokenMask | None = None) -> tuple[list[int], list[Logprobs | None]]:
        """logits: [N, vocab] float32, one row per entry of `infos`; allowed: see `sample`."""
        tokens = self.sample(logits, infos, allowed=allowed)
        lp = device_logprobs(logits, tokens, infos)
        token_list = tokens.tolist()
        lps: list[Logprobs | None] = [None] * len(infos)
        if lp is not None:
            for row, x in lp.build(token_list).items():
                lps[row] = x
        return token_list, lps

    def sample(self, logits: torch.Tensor, infos: list[SamplingInfo], pending: torch.Tensor | None = None,
               allowed: torch.Tensor | TokenMask | None = None) -> torch.Tensor:
        """The sampled ids, [N] on the logits' device, without waiting for the device: every per-row value
        reaches it through a pinned, non-blocking copy. `pending` ([N] on the device) samples for the step
        after the one that sampled these ids, before they reach the host: each row's output then ends with its
        pending id (penalties count it) and a seeded row draws for the next output index. `allowed` ([N, vocab]
        bool): only those tokens may be drawn (a grammar's, structured output), masked before anything else; a
        `TokenMask` (host) is read only as far as the draw needs it (see `_sample_under_grammar`)."""
        ahead = 0 if pending is None else 1
        if allowed is not None and self.device.type == "cpu":
            return self._sample_under_grammar(logits, infos, pending, allowed)
        if isinstance(allowed, TokenMask):
            allowed = allowed.full()
        if allowed is not None:          # [N, vocab] bool: a grammar's tokens (structured output), before all else
            logits = torch.where(allowed, logits, float("-inf"))
        logits = self._apply_bias_and_penalties(logits, infos, pending)
        return _argmax(self._race_scores(logits, infos, ahead))

    def _sample_under_grammar(self, logits: torch.Tensor, infos: list[SamplingInfo], pending: torch.Tensor | None,
                              allowed: torch.Tensor | TokenMask) -> torch.Tensor:
        """On the host, under a grammar: each row's token is the argmax of its race scores (`_race_scores`), and
        masking drops the banned ids' scores without changing the others' (bias and penalties move only finite
        logits; temperature and the draw are per id; the softmax's normaliser is one constant a row). So where the
        grammar allows a row's unmasked winner it is the masked winner too, and only the other rows need their
        mask (`_masked_argmax`). A row with top-k, top-p or min-p is masked first: those read the masked
        distribution."""
        filtered = [r for r, i in enumerate(infos) if needs_mask_first(i.params)]
        if filtered:
            rows = allowed.rows(filtered) if isinstance(allowed, TokenMask) else allowed[filtered]
            logits = logits.clone()
            logits[filtered] = torch.where(rows, logits[filtered], float("-inf"))
        scores = self._race_scores(self._apply_bias_and_penalties(logits, infos, pending), infos,
                                   0 if pending is None else 1)
        return self._masked_argmax(scores, allowed)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A small host list on the device, without synchronising it (torch waits for the stream on a
        blocking copy from pageable memory)."""
        t = torch.tensor(values, dtype=dtype)
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ processing
    def _apply_bias_and_penalties(self, logits: torch.Tensor, infos: list[SamplingInfo],
                                  pending: torch.Tensor | None = None) -> torch.Tensor:
        ahead = 0 if pending is None else 1
        blocked = [i.min_tokens_blocked_ids(ahead) if i.params.min_tokens else [] for i in infos]
        rows = [r for r, i in enumerate(infos) if i.params.logit_bias or i.params.needs_penalties or blocked[r]]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        # every row's logit_bias in one indexed add (each (row, id) once: the same sums as a row at a time)
        biased = [(r, t, v) for r in rows for t, v in (infos[r].params.logit_bias or {}).items() if t < vocab]
        if biased:
            at_rows, at_ids, vals = zip(*biased)
            logits.index_put_((self._tensor(list(at_rows), torch.long), self._tensor(list(at_ids), torch.long)),
                              self._tensor(list(vals), logits.dtype), accumulate=True)
        for r in rows:
            p = infos[r].params
            if not (p.needs_penalties or blocked[r]):
                continue
            row = logits[r]
            last = None if pending is None else pending[r:r + 1]          # [1]: an output id not on the host yet
            if p.repetition_penalty != 1.0:
                rp = p.repetition_penalty
                seen = self._tensor(sorted(set(infos[r].prompt_token_ids) | set(infos[r].output_token_ids)),
                                    torch.long)
                vals = row[seen]
                row[seen] = torch.where(vals > 0, vals / rp, vals * rp)
                if last is not None:                  # once more for the pending id, unless already seen
                    v = row.gather(0, last)
                    fresh = ~torch.isin(last, seen)
                    row.scatter_(0, last, torch.where(fresh, torch.where(v > 0, v / rp, v * rp), v))
            if (p.presence_penalty or p.frequency_penalty) and (infos[r].output_token_ids or last is not None):
                counts = torch.zeros(vocab, dtype=torch.long, device=row.device)
                if infos[r].output_token_ids:
                    counts += torch.bincount(self._tensor(infos[r].output_token_ids, torch.long),
                                             minlength=vocab)[:vocab]
                if last is not None:
                    counts.index_add_(0, last, torch.ones_like(last))
                counts = counts.to(row.dtype)
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
            if blocked[r]:
                ids = [t for t in blocked[r] if t < vocab]
                row[self._tensor(ids, torch.long)] = float("-inf")
        return logits

    def _masked_argmax(self, logits: torch.Tensor, allowed: torch.Tensor | TokenMask) -> torch.Tensor:
        """The row argmax of `logits` (greedy rows' logits, sampled rows' race scores) under a grammar, on the
        host: where the grammar allows a row's argmax, that is the masked
        argmax too (the first maximum overall, so the first among the allowed), so only the other rows pay the
        mask's pass over the vocabulary (a model that follows its format rarely needs it), and a `TokenMask`
        fills only theirs. When most rows needed it, the next steps mask every row at once instead (a random
        model, a forbidding state): 1, then 2, 4, ... up to _MASK_ALL_STEPS steps while that repeats; a step
        where most argmaxes are allowed starts over at 1."""
        lazy = isinstance(allowed, TokenMask)
        num_ids = allowed.num_ids if lazy else logits.shape[1]
        if self._mask_all_steps > 0:
            self._mask_all_steps -= 1
            return _whole_masked_argmax(logits, allowed, num_ids)
        if num_ids < logits.shape[1]:
            # ids past the tokenizer (a padded vocabulary) no grammar allows: a constrained row's winner is among
            # the others (a random model's is mostly past them, and would be refused)
            tokens = _argmax(logits[:, :num_ids])                                   # [N]
            if free := allowed.rows_without_grammar():
                tokens[free] = _argmax(logits[free])
        else:
            tokens = _argmax(logits)                                                # [N]
        if lazy:
            # a matcher that allows its row's argmax takes it now (it is that row's token): the engine's
            # accept then only confirms it; undone if the whole mask is filled below
            token_list = tokens.tolist()
            bad = [r for r, ok in enumerate(allowed.allows(token_list, keep=True)) if not ok]
        else:               # rows whose argmax is banned
            bad = (~allowed.gather(1, tokens[:, None]).squeeze(1)).nonzero().flatten().tolist()
        if 2 * len(bad) > len(tokens):
            self._mask_all_steps = self._mask_all_backoff
            self._mask_all_backoff = min(2 * self._mask_all_backoff, _MASK_ALL_STEPS)
            return _whole_masked_argmax(logits, allowed, num_ids)
        self._mask_all_backoff = 1
        if bad and lazy:
            tokens[bad] = torch.tensor(_next_allowed(logits, bad, [token_list[r] for r in bad], allowed, num_ids))
        elif bad:
            tokens[bad] = _argmax(torch.where(allowed[bad], logits[bad], float("-inf")))
        return tokens

    def _race_scores(self, logits: torch.Tensor, infos: list[SamplingInfo], ahead: int = 0) -> torch.Tensor:
        """[N, vocab] scores whose row argmax is each row's token: a greedy row's logits as they are; a sampled
        row's exponential race, argmax(p / E) with p its distribution (temperature, then top-k, top-p, min-p) and
        E ~ Exp(1) one draw per id, which draws from p. Taken in log space, logits / T - log E (ids the filters
        drop at -inf): the same argmax, with no softmax, and an id whose probability underflows in the whole
        vocabulary still competes by its logit (a grammar may leave only such ids)."""
        sampled = [r for r, i in enumerate(infos) if not i.params.is_greedy]
        if not sampled:
            return logits
        every = len(sampled) == len(infos)
        x = logits if every else logits[self._tensor(sampled, torch.long)]
        temps = [infos[r].params.temperature for r in sampled]
        if any(t != 1.0 for t in temps):
            x = x / self._tensor(temps, x.dtype)[:, None]
        x = _filter(x, [infos[r] for r in sampled])
        scores = _neg_log_(self._exponentials(infos, sampled, x.shape[1], ahead)).add_(x)      # [S, vocab]
        if every:
            return scores
        out = logits.to(scores.dtype, copy=True)
        out[self._tensor(sampled, torch.long)] = scores
        return out

    def _exponentials(self, infos: list[SamplingInfo], rows: list[int], vocab: int, ahead: int) -> torch.Tensor:
        """[len(rows), vocab] float32 on the device: rows `rows`' E ~ Exp(1), as `Tensor.exponential_` draws
        them: the unseeded rows in order from the sampler's generator, a seeded row from its (seed, output
        index) generator."""
        seeds = [infos[r].params.seed for r in rows]
        out_index = [infos[r].num_output_tokens + ahead for r in rows]
        if self.device.type == "cpu":
            # exponential_ computes -log1p(-u) per id in double, in a serial loop (~15 ns an id); the same uniform
            # doubles drawn by uniform_ and numpy's vectorised log1p give the same float32 E (see
            # _exp_from_uniform) in about a third of the time
            u = torch.empty(len(rows), vocab, dtype=torch.float64)
            for k, seed in enumerate(seeds):
                if seed is None:
                    u[k].uniform_(generator=self.generator)
                else:
                    self._seeded.manual_seed(_mix(seed, out_index[k]))
                    u[k].uniform_(generator=self._seeded)
            return torch.from_numpy(_exp_from_uniform(u.numpy()))
        e = torch.empty(len(rows), vocab, device=self.device)
        unseeded = [k for k, seed in enumerate(seeds) if seed is None]
        if unseeded:
            draws = torch.empty(len(unseeded), vocab, device=self.device).exponential_(generator=self.generator)
            e[self._tensor(unseeded, torch.long)] = draws
        for k, seed in enumerate(seeds):
            if seed is not None:
                self._seeded.manual_seed(_mix(seed, out_index[k]))
                e[k].exponential_(generator=self._seeded)
        return e


def needs_mask_first(params: SamplingParams) -> bool:
    """Whether a row's draw reads its grammar's whole mask before it draws: top-k, top-p and min-p choose from
    the masked distribution. Other rows (greedy, or temperature alone) can ask their grammar about their
    unmasked winner first (see `Sampler._sample_under_grammar`)."""
    return not params.is_greedy and bool(params.top_k or params.top_p < 1.0 or params.min_p > 0)


def _exp_from_uniform(u: np.ndarray) -> np.ndarray:
    """u: [R, vocab] float64 uniform draws as `uniform_` makes them (53 random bits) -> [R, vocab] float32
    E = float32(-log1p(-u)), what torch's CPU `exponential_` computes from the same draws. numpy's log1p (SIMD)
    and the C library's differ by one double ulp in a few percent of inputs, which moves the float32 E only where
    the double lies that close to halfway between two floats (about 1 id in 10^10); E was equal to
    exponential_'s in all 120 million ids compared."""
    d = np.negative(u)
    np.log1p(d, out=d)                               # log1p(-u) = -E, in double
    e = d.astype(np.float32)
    return np.negative(e, out=e)


def _neg_log_(e: torch.Tensor) -> torch.Tensor:
    """-log E in place, E below the smallest normal float (a uniform draw of exactly 0 gives E = 0) taken as it:
    a score stays finite, so a banned id's stays -inf. numpy's log on the host (4x torch's there)."""
    if e.device.type != "cpu":
        return e.clamp_(min=_TINY).log_().neg_()
    x = e.numpy()
    np.maximum(x, _TINY, out=x)
    np.log(x, out=x)
    np.negative(x, out=x)
    return e


def _whole_masked_argmax(logits: torch.Tensor, allowed: torch.Tensor | TokenMask, num_ids: int) -> torch.Tensor:
    """The masked argmax of every row, the mask filled whole; with a padded vocabulary (`num_ids` below the
    logits' width) only the tokenizer's ids are unpacked and searched for constrained rows (no grammar allows
    the others), rows without a grammar over all ids."""
    if not isinstance(allowed, TokenMask):
        return _argmax(torch.where(allowed, logits, float("-inf")))
    if num_ids >= logits.shape[1]:
        return _argmax(torch.where(allowed.full(), logits, float("-inf")))
    tokens = _argmax(torch.where(allowed.full(num_ids), logits[:, :num_ids], float("-inf")))
    if free := allowed.rows_without_grammar():
        tokens[free] = _argmax(logits[free])
    return tokens


def _next_allowed(logits: torch.Tensor, bad: list[int], refused: list[int], mask: TokenMask,
                  num_ids: int | None = None) -> list[int]:
    """The masked argmax of rows `bad` (whose raw argmax, `refused`, their grammar bans), asking before filling:
    argmax visits a row's ids by value down, then index up, so the first one the grammar allows in that order
    is the masked argmax (the first maximum among the allowed). Up to _ASK_TRIES times the id just refused is
    set to -inf and the next argmax asked (numpy on the host, in place on those rows, restored before
    returning: a few rows, where torch's per-op cost would dominate); an allowed one is kept by its matcher
    (see `TokenMask.allows`). Rows still without one take their filled mask. Only ids below `num_ids` are
    searched (the others are never allowed: `TokenMask.num_ids`)."""
    out = list(refused)
    left = list(range(len(bad)))
    if _ASK_TRIES:
        if logits.dtype == torch.float32 and logits.is_contiguous():
            x, at = logits.numpy(), bad                    # a view: refused ids set to -inf, then restored
        else:
            x, at = logits[bad].float().numpy(), range(len(bad))     # a copy
        saved: list[tuple[int, int, float]] = []
        try:
            for _ in range(_ASK_TRIES):
                for k in left:
                    r, t = at[k], out[k]
                    saved.append((r, t, float(x[r, t])))
                    x[r, t] = -np.inf
                ids = [int(x[at[k], :num_ids].argmax()) for k in left]
                ok = mask.allows(ids, [bad[k] for k in left], keep=True)
                still = []
                for k, t, a in zip(left, ids, ok):
                    out[k] = t
                    if not a:
                        still.append(k)
                left = still
                if not left:
                    return out
        finally:
            for r, t, v in reversed(saved):
                x[r, t] = v
    rows = [bad[k] for k in left]
    for k, t in zip(left, _argmax(torch.where(mask.rows(rows), logits[rows], float("-inf"))).tolist()):
        out[k] = t
    return out


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (the first index of the maximum, as `argmax`). `max(dim)` computes the same index and on
    CPU is 2.5-3x faster than `argmax` (torch 2.13, [32, 32000] float32: 0.25 ms against 0.73 ms)."""
    return x.max(dim=-1).indices


def _filter(x: torch.Tensor, infos: list[SamplingInfo]) -> torch.Tensor:
    """x: [N, vocab] logits over temperature of sampled rows; the ids top-k, top-p and min-p remove from each
    row's distribution softmax(x) set to -inf (rows without filters untouched)."""
    rows = [r for r, i in enumerate(infos) if needs_mask_first(i.params)]
    if not rows:
        return x
    x = x.clone()
    probs = torch.softmax(x[rows], dim=-1)                                   # [R, vocab]
    for j, r in enumerate(rows):
        x[r].masked_fill_(~_kept(probs[j], infos[r].params), float("-inf"))
    return x


def _kept(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[vocab] bool: the ids top-k, top-p and min-p keep of one row's distribution, always its most likely:
    the k most likely; of those, the smallest prefix (most likely first) whose mass reaches top_p; of those, the
    ones at least min_p times as likely as the first. Only the prefix top-p needs is ordered: the most likely
    256, then 4x as many while their mass is short of top_p (a model's distribution is mostly in its first few
    hundred ids; sorting a 32,000-id row took ~1-3 ms here, the top 256 ~25 us)."""
    vocab = probs.shape[0]
    if not p.top_k and p.top_p >= 1.0:                 # min-p alone: no order needed
        keep = probs >= p.min_p * probs.max()
        return keep
    limit = min(p.top_k or vocab, vocab)
    # on a device, reading top-p's mass on the host would wait for it: order the whole prefix there
    n = limit if p.top_p >= 1.0 or probs.device.type != "cpu" else min(limit, 256)
    while True:
        vals, idx = probs.topk(n)                      # [n], most likely first
        keep = torch.ones(n, dtype=torch.bool, device=probs.device)
        if p.top_p < 1.0:
            keep = (vals.cumsum(0) - vals) < p.top_p    # the smallest prefix reaching top_p
            if n < limit and keep[-1]:                 # it goes on past these: order more
                n = min(4 * n, limit)
                continue
        break
    if p.min_p > 0:
        keep &= vals >= p.min_p * vals[0]
    keep[0] = True
    mask = torch.zeros(vocab, dtype=torch.bool, device=probs.device)
    mask[idx] = keep
    return mask


def _mix(seed: int, step: int) -> int:
    return (seed * _SEED_MIX + step * 0x632BE59BD9B4E019 + 1) & 0x7FFFFFFFFFFFFFFF


@dataclass(slots=True)
class DeviceLogprobs:
    """The logprobs a decode step hands out, still on the device (overlap_decode): for the rows in `rows`,
    each sampled id's log-probability and rank and the top max(ks) alternatives, computed as `Sampler.__call__`
    computes them. `to_host` queues their copy without waiting; `build` reads them once the copy is done."""

    rows: list[int]
    ks: list[int]
    chosen: torch.Tensor                  # [R]
    ranks: torch.Tensor                   # [R]
    top_v: torch.Tensor | None            # [R, max(ks)], None when every k is 0
    top_i: torch.Tensor | None

    def to_host(self) -> "DeviceLogprobs":
        """Copies queued to host memory (pinned, from CUDA: the copy does not block); read after the stream
        has reached them."""
        def host(t):
            return None if t is None else t.to("cpu", non_blocking=True)
        return DeviceLogprobs(self.rows, self.ks, host(self.chosen), host(self.ranks), host(self.top_v),
                              host(self.top_i))

    def build(self, tokens: list[int]) -> dict[int, Logprobs]:
        """{row: Logprobs} given every row's sampled id (host values)."""
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        top_v = self.top_v.tolist() if self.top_v is not None else None
        top_i = self.top_i.tolist() if self.top_i is not None else None
        return {row: Logprobs(tokens[row], chosen[j], ranks[j], top_i[j][:k] if k else [], top_v[j][:k] if k else [])
                for j, (row, k) in enumerate(zip(self.rows, self.ks))}


def device_logprobs(logits: torch.Tensor, tokens: torch.Tensor, infos: list[SamplingInfo]) -> DeviceLogprobs | None:
    """Logprobs for the rows of `infos` that ask for them, of `tokens` ([N], on the device) under the raw
    `logits` (before bias and penalties), without a host sync; None if no row asks."""
    rows = [r for r, i in enumerate(infos) if i.params.logprobs is not None]
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.long)
    if logits.device.type == "cuda":
        index = index.pin_memory().to(logits.device, non_blocking=True)
    return _select_logprobs(torch.log_softmax(logits[index], dim=-1), tokens[index], rows,
                            [infos[r].params.logprobs for r in rows])


def _select_logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[int], ks: list[int]) -> DeviceLogprobs:
    """raw: [R, vocab] log-probabilities; tokens: [R] the ids whose logprob and rank to take; top max(ks)."""
    chosen = raw.gather(1, tokens[:, None])                                # [R, 1]
    ranks = (raw > chosen).sum(dim=1) + 1
    top_v = top_i = None
    if max(ks):
        top_v, top_i = raw.topk(max(ks), dim=-1)
    return DeviceLogprobs(rows, ks, chosen[:, 0], ranks, top_v, top_i)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[Logprobs]:
    """One Logprobs per row: the given token's log-probability and rank, plus the top-k alternatives.

    logprobs: [N, vocab] (log_softmax output); token_ids: [N] long. Host syncs per batch, not per row.
    """
    n = token_ids.shape[0]
    if n == 0:
        return []
    return list(_select_logprobs(logprobs, token_ids, list(range(n)), [k] * n).build(token_ids.tolist()).values())
