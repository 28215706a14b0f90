"""One sequence's grammar (`GrammarState`) and one step's allowed tokens (`GrammarBitmask`): the values the
request and the step plan carry. No engine imports, so `engine.request` and `engine.types` can name them
without an import cycle through the manager that makes them."""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Protocol
from concurrent.futures import Executor, Future, wait

import numpy as np
import torch

from affinity_serve.engine.structured_output.spec import StructuredOutputSpec
from affinity_serve.engine.structured_output.utf8 import REJECT, Utf8Tables, advance

logger = logging.getLogger(__name__)


class GrammarState:
    """One sequence's grammar: its compile (shared through the cache) and, once compiled, its own matcher, and
    its output's UTF-8 state (`utf8`: which tokens may come next and keep the bytes valid UTF-8)."""

    __slots__ = ("spec", "is_json", "_future", "_matcher", "_prefix", "_ahead", "_tables", "_utf8")

    def __init__(self, spec: StructuredOutputSpec, future: Future, prefix: tuple[int, ...] = (),
                 utf8: Utf8Tables | None = None):
        self.spec = spec
        #: JSON (a schema or any object): no token with a control byte is allowed (see the manager's _fill)
        self.is_json = spec.key[0] in ("json", "json_object")
        self._future = future
        self._matcher = None
        # tokens sampled under this grammar elsewhere (P/D: the prefill engine's first token), taken first
        self._prefix = prefix
        #: a token its matcher took when the sampler asked about it (see `RowCheck.allows`), not yet accepted
        self._ahead: int | None = None
        #: the tokenizer's UTF-8 tables (built with the compiler, so before this compile is done; None: the
        #: output's UTF-8 is not followed) and the output's state in them: 0, at a character's start
        self._tables = utf8
        self._utf8 = 0

    @property
    def is_ready(self) -> bool:
        """Compiled, or failed (see `error`): either way the request leaves WAITING_FOR_GRAMMAR."""
        return self._future.done()

    @property
    def error(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr
            m = xgr.GrammarMatcher(self._future.result())
            rows = self._tables.next_rows if self._tables is not None else None
            for t in self._prefix:
                after = advance(rows, self._utf8, [t]) if rows is not None else 0
                if after == REJECT or not m.accept_token(t):   # the other engine masked it the same: a mismatch
                    logger.error("token %s sampled before this engine is outside the grammar; going on from "
                                 "the tokens accepted", t)
                    break
                self._utf8 = after
            self._matcher = m
        return self._matcher

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance over sampled tokens; False if one is outside the grammar, or makes the output invalid UTF-8
        (the mask allows neither; then the rest are not taken, and the sequence is ended)."""
        ok = self._accept(token_ids)
        if ok and self._tables is not None:
            after = advance(self._tables.next_rows, self._utf8, token_ids)
            if after == REJECT:
                return False
            self._utf8 = after
        return ok

    def _accept(self, token_ids: Sequence[int]) -> bool:
        m = self._matcher if self._matcher is not None else self.matcher
        ahead = self._ahead
        if ahead is not None:            # taken already when the sampler asked: the same token is accepted
            self._ahead = None
            if token_ids and token_ids[0] == ahead:
                if len(token_ids) == 1:
                    return True
                token_ids = token_ids[1:]
            else:                        # another token (none is, where the sampler kept it): undo it first
                m.rollback(1)
        if len(token_ids) == 1:                                 # a decode step's one token
            return m.accept_token(token_ids[0])
        return all(m.accept_token(t) for t in token_ids)      # False past the grammar's end too

    def settle(self) -> None:
        """Undo a token taken ahead (see `RowCheck.allows`) and not accepted: the matcher as before asking."""
        if self._ahead is not None:
            self._ahead = None
            self._matcher.rollback(1)

    @property
    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()


class GrammarBitmask:
    """The step's allowed tokens for its constrained sampling rows: `req_ids[i]` owns row i of the packed bitmask
    (int32 words, bit j of word w allows token 32w + j).

    Its fill overlaps the step's forward: started on the manager's worker thread when the step is scheduled
    (`executor` given), or run when the sampler first reads it, which the runner does after launching the
    forward, so on a GPU the host fills while the device computes. Either way the sampler masks with this step's
    exact bitmask: the fill reads matchers that accepted the previous step's tokens, and none advances before
    this step's tokens are sampled."""

    __slots__ = ("_check", "_fill", "_future", "_packed", "_unpacked", "req_ids")

    def __init__(self, req_ids: list[str], fill: Callable[[], torch.Tensor], executor: Executor | None = None,
                 vocab_size: int | None = None, check: RowCheck | None = None):
        """`fill` returns the packed bitmask; with `executor` it runs there at once, and with `vocab_size` the
        thread also unpacks it to the [R, vocab_size] boolean mask a host sampler applies. `check` (a step that
        fills nothing ahead): asks the matchers about single tokens and fills chosen rows alone (see
        `TokenMask`)."""
        self.req_ids = req_ids
        self._fill: Callable[[], torch.Tensor] | None = fill
        self._check = check
        self._future = (executor.submit(_fill_and_unpack, fill, vocab_size) if executor is not None else None)
        self._packed: torch.Tensor | None = None
        self._unpacked: torch.Tensor | None = None

    @property
    def packed(self) -> torch.Tensor:
        """[len(req_ids), ceil(vocab / 32)] int32 on the host (filled now, or waited for)."""
        if self._packed is None:
            fill, self._fill = self._fill, None        # drops the matchers
            if self._future is not None:
                self._packed, self._unpacked = self._future.result()
            else:
                self._packed = fill()
        return self._packed

    def wait(self) -> None:
        """Until no fill runs (one started on the thread has ended; a lazy one unread never runs), so the
        matchers may advance or be dropped. Raises nothing: a fill's error is raised where it is read."""
        self._fill = self._check = None
        if self._future is not None:
            wait([self._future])

    def sampler_mask(self, row_req_ids: Sequence[str], vocab_size: int, device: torch.device
                     ) -> TokenMask | torch.Tensor | None:
        """What the sampler masks `row_req_ids` with: a `TokenMask` where this step may fill rows alone (a host
        sampler, nothing filled ahead), else `token_mask`'s tensor."""
        if self._check is None or self._packed is not None or device.type != "cpu":
            return self.token_mask(row_req_ids, vocab_size, device)
        if row_req_ids == self.req_ids:                 # every sampling row constrained, in order (a decode step)
            return TokenMask(self, list(range(len(row_req_ids))), vocab_size)
        index = {r: i for i, r in enumerate(self.req_ids)}
        rows = [index.get(r) for r in row_req_ids]
        return TokenMask(self, rows, vocab_size) if any(i is not None for i in rows) else None

    def token_mask(self, row_req_ids: Sequence[str], vocab_size: int, device: torch.device) -> torch.Tensor | None:
        """[len(row_req_ids), vocab_size] bool on `device`, True where allowed (rows without a grammar all True);
        None if no row is constrained."""
        index = {r: i for i, r in enumerate(self.req_ids)}
        hits = [(j, index[r]) for j, r in enumerate(row_req_ids) if r in index]
        if not hits:
            return None
        packed = self.packed
        same_rows = len(hits) == len(row_req_ids) and all(j == i for j, i in hits)
        unpacked = self._unpacked
        if same_rows and device.type == "cpu" and unpacked is not None and unpacked.shape[1] == vocab_size:
            return unpacked                             # unpacked on the thread, during the forward
        if not same_rows:
            rows = torch.full((len(row_req_ids), packed.shape[1]), -1, dtype=torch.int32)   # all allowed
            rows[[j for j, _ in hits]] = packed[[i for _, i in hits]]
            packed = rows
        if device.type == "cuda":          # the packed words cross (32x smaller), the device unpacks them
            packed = (packed if packed.is_pinned() else packed.pin_memory()).to(device, non_blocking=True)
        return unpack_bitmask(packed, vocab_size)


class RowCheck(Protocol):
    """The manager's single-row access to a step's matchers (row i: `GrammarBitmask.req_ids[i]`)."""

    def allows(self, rows: Sequence[int], token_ids: Sequence[int], keep: bool = False) -> list[bool]:
        """Whether row rows[k]'s grammar allows token_ids[k] next. Its matcher does not advance, unless `keep`:
        then a matcher that allows its token keeps it (taken ahead: the engine's accept of that token then
        only confirms it), until `release`."""

    #: no grammar allows an id at or past this (the tokenizer's ids end here; the logits may be wider)
    num_ids: int

    def release(self) -> None:
        """Undo every token kept by `allows(keep=True)` and not accepted yet."""

    def fill(self, rows: Sequence[int]) -> torch.Tensor:
        """[len(rows), ceil(vocab / 32)] int32: those rows' packed bitmask alone."""


class TokenMask:
    """A host sampler's view of a step's grammar mask over its sampling rows (`rows[k]`: row k's row of the
    bitmask, None for a row without a grammar), filled only as far as it is read: the sampler asks whether
    each row's grammar allows its unmasked winner (argmax or race; one accept of the matcher, ~1 us, against a
    fill of 1-15 us a row on a 32,000-token vocabulary) and needs the mask of the rows it does not allow only."""

    __slots__ = ("_bitmask", "_rows", "_vocab_size")

    def __init__(self, bitmask: GrammarBitmask, rows: list[int | None], vocab_size: int):
        self._bitmask = bitmask
        self._rows = rows
        self._vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def num_ids(self) -> int:
        """No grammar allows an id at or past this: the tokenizer's ids end here in a padded vocabulary."""
        check = self._bitmask._check
        return min(self._vocab_size, getattr(check, "num_ids", self._vocab_size))

    def rows_without_grammar(self) -> list[int]:
        """The sampling rows no grammar constrains (every id allowed)."""
        return [k for k, i in enumerate(self._rows) if i is None]

    def allows(self, token_ids: Sequence[int], rows: Sequence[int] | None = None, keep: bool = False
               ) -> list[bool]:
        """Whether each sampling row's grammar allows token_ids[k] (k: the row, or the kth of `rows`; rows
        without a grammar allow every id). `keep`: each matcher that allows its token takes it now (the
        sampler's final choice for that row; see `RowCheck.allows`); `full` undoes that first, and a row filled
        alone (`rows`) is settled before its fill."""
        bm = self._bitmask
        own = self._rows
        if rows is None:
            if bm._packed is None and bm._check is not None and None not in own:
                return bm._check.allows(own, token_ids, keep)     # every row constrained: no index to build
            rows = range(len(own))
        out = [True] * len(rows)
        hits = [(k, own[r]) for k, r in enumerate(rows) if own[r] is not None]
        if bm._packed is not None or bm._check is None:          # filled already: read the bits
            words = bm.packed
            for k, i in hits:
                t = token_ids[k]
                out[k] = t < self._vocab_size and bool((int(words[i, t >> 5]) >> (t & 31)) & 1)
            return out
        for (k, _), ok in zip(hits, bm._check.allows([i for _, i in hits], [token_ids[k] for k, _ in hits], keep)):
            out[k] = ok
        return out

    def rows(self, rows: Sequence[int]) -> torch.Tensor:
        """[len(rows), vocab_size] bool, True where allowed: those sampling rows' masks, filled for them alone
        (or read from a whole fill)."""
        bm = self._bitmask
        idx = [self._rows[k] for k in rows]
        hit = [j for j, i in enumerate(idx) if i is not None]
        num_words = -(-self._vocab_size // 32)
        packed = torch.full((len(rows), num_words), -1, dtype=torch.int32)      # rows without a grammar: all
        if hit:
            src = (bm.packed[[idx[j] for j in hit]] if bm._packed is not None or bm._check is None
                   else bm._check.fill([idx[j] for j in hit]))
            packed[hit] = src
        return unpack_bitmask(packed, self._vocab_size)

    def full(self, num_ids: int | None = None) -> torch.Tensor:
        """[len(rows), vocab_size] bool: every sampling row's mask (the whole bitmask, filled now); its first
        `num_ids` ids only, if given."""
        bm = self._bitmask
        if bm._check is not None:
            bm._check.release()           # the fill reads the matchers as the step found them
        bm._check = None                  # filled whole from here on
        return bm.token_mask([bm.req_ids[i] if i is not None else None for i in self._rows],
                             num_ids or self._vocab_size, torch.device("cpu"))


def _fill_and_unpack(fill: Callable[[], torch.Tensor], vocab_size: int | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    packed = fill()
    return packed, (unpack_bitmask(packed, vocab_size) if vocab_size is not None else None)


_BIT_TABLES: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 -> [R, vocab_size] bool (bit j of word w is token 32w + j), on the bitmask's device.

    Through a byte lookup table: the words' bytes (little-endian: byte k holds bits 8k..8k+7) index a [256, 8]
    table of their bits; about 25x faster on CPU than shifting every word by 0..31."""
    assert sys.byteorder == "little", "the packed words are read as little-endian bytes"
    if bitmask.device.type == "cpu":      # numpy's unpackbits: ~10x faster than the table below on CPU
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=-1, count=vocab_size,
                             bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)
    table = _BIT_TABLES.get(bitmask.device)
    if table is None:
        b = torch.arange(256, dtype=torch.int32)
        table = ((b[:, None] >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(bitmask.device)   # [256, 8]
        _BIT_TABLES[bitmask.device] = table
    as_bytes = bitmask.contiguous().view(torch.uint8)                                   # [R, 4W]
    return table[as_bytes.long()].reshape(bitmask.shape[0], -1)[:, :vocab_size]
