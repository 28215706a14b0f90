"""The structured-output manager: grammars compiled off the step loop (xgrammar), cached by spec, one matcher
per sequence, and the token bitmask each step applies to its constrained rows."""
from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ThreadPoolExecutor, wait
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from affinity_serve.engine.structured_output.spec import StructuredOutputSpec, import_xgrammar

if TYPE_CHECKING:
    from affinity_serve.engine.request import Request
    from affinity_serve.engine.types import SchedulerOutput

#: compiled grammars kept (least recently used dropped first)
_CACHE_SIZE = 512
#: from this many constrained rows a step fills the bitmask with xgrammar's batch matcher (threads)
_BATCH_FILL_MIN_ROWS = 8
#: from this many, with fill_on_thread, on the worker thread (fewer fill in less than the hand-off costs)
_THREAD_FILL_MIN_ROWS = 4


class GrammarState:
    """One sequence's grammar: its compile (shared through the cache) and, once compiled, its own matcher."""

    __slots__ = ("spec", "_future", "_matcher")

    def __init__(self, spec: StructuredOutputSpec, future: Future):
        self.spec = spec
        self._future = future
        self._matcher = None

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
            self._matcher = xgr.GrammarMatcher(self._future.result())
        return self._matcher

    def accept(self, token_ids: Iterable[int]) -> bool:
        """Advance over sampled tokens; False if one is outside the grammar (then the rest are not taken)."""
        m = self.matcher
        return all(m.accept_token(t) for t in token_ids)      # False past the grammar's end too

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

    __slots__ = ("_fill", "_future", "_packed", "_unpacked", "req_ids")

    def __init__(self, req_ids: list[str], fill: Callable[[], torch.Tensor], executor: Executor | None = None,
                 vocab_size: int | None = None):
        """`fill` returns the packed bitmask; with `executor` it runs there at once, and with `vocab_size` the
        thread also unpacks it to the [R, vocab_size] boolean mask a host sampler applies."""
        self.req_ids = req_ids
        self._fill: Callable[[], torch.Tensor] | None = fill
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
        self._fill = None
        if self._future is not None:
            wait([self._future])

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


def _fill_and_unpack(fill: Callable[[], torch.Tensor], vocab_size: int | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    packed = fill()
    return packed, (unpack_bitmask(packed, vocab_size) if vocab_size is not None else None)


def _no_control_byte_tokens(decoded_vocab: Sequence[bytes], vocab_size: int,
                            stop_token_ids: Sequence[int]) -> torch.Tensor:
    """[vocab_size] bool: tokens whose bytes hold no control character (< 0x20); stop tokens always."""
    ok = torch.zeros(vocab_size, dtype=torch.bool)
    ok[[i for i, b in enumerate(decoded_vocab[:vocab_size]) if not any(c < 0x20 for c in b)]] = True
    ok[[t for t in stop_token_ids if t < vocab_size]] = True
    return ok


def _pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """[vocab] bool -> [ceil(vocab / 32)] int32 words (bit j of word w: token 32w + j), as xgrammar packs."""
    n = -(-allowed.shape[0] // 32) * 32
    bits = torch.zeros(n, dtype=torch.int64)
    bits[:allowed.shape[0]] = allowed.long()
    words = (bits.view(-1, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


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


class StructuredOutputManager:
    """Owned by the engine: compiles grammars on one worker thread, caches them by spec, builds each step's
    bitmask on another. `tokenizer` is the engine's (Hugging Face) tokenizer, `vocab_size` the logits' width,
    `stop_token_ids` the ids that end a sequence (a finished grammar allows only these). `fill_on_thread`:
    each step's bitmask is filled on a worker thread from the moment the step is scheduled; otherwise when the
    sampler reads it (see `GrammarBitmask`); a step with fewer than `_THREAD_FILL_MIN_ROWS` constrained rows
    fills when read either way. `pin_memory`: the bitmask is filled in pinned host memory (it
    crosses to a CUDA device without a staging copy)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], *,
                 fill_on_thread: bool = False, pin_memory: bool = False):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.fill_on_thread = fill_on_thread
        self.pin_memory = pin_memory
        self._executor: ThreadPoolExecutor | None = None
        self._fill_executor: ThreadPoolExecutor | None = None
        self._compiler = None                       # built on the worker thread by the first compile
        #: [ceil(vocab / 32)] int32: every token but those holding a control byte (see _compile_now)
        self._no_control_bytes: torch.Tensor | None = None
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._batch_matcher = None
        self.num_compiles = 0
        self.num_cache_hits = 0

    def new_state(self, spec: StructuredOutputSpec) -> GrammarState:
        """A sequence's grammar state; its compile starts now (or is the cached one)."""
        return GrammarState(spec, self._compile(spec))

    def _compile(self, spec: StructuredOutputSpec) -> Future:
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return fut
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
            fut = self._executor.submit(self._compile_now, key)
            self._cache[key] = fut
            self.num_compiles += 1
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def _compile_now(self, key: tuple[str, str]):
        """On the worker thread: the token-level compile (xgrammar's adaptive token mask cache)."""
        if self._compiler is None:
            xgr = import_xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            self._no_control_bytes = _pack_bits(_no_control_byte_tokens(info.decoded_vocab, self.vocab_size,
                                                                        self.stop_token_ids))
        kind, text = key
        # compact JSON (no free whitespace between tokens, as vLLM's disable_any_whitespace): a model can
        # otherwise spend its max_tokens on blanks the grammar allows
        if kind == "json":
            return self._compiler.compile_json_schema(text, any_whitespace=False)
        if kind == "json_object":
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return self._compiler.compile_regex(text)
        return self._compiler.compile_grammar(text)

    def wait_for_compile(self, states: Iterable[GrammarState], timeout_s: float) -> None:
        """Block up to `timeout_s` until one of `states` is compiled (the engine calls this only when a step
        has nothing else to run, so the loop does not spin while grammars compile)."""
        pending = [s._future for s in states if not s.is_ready]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def grammar_bitmask(self, so: SchedulerOutput, requests: Mapping[str, Request]) -> GrammarBitmask | None:
        """The bitmask for this step's constrained rows that sample (whose computed tokens reach their known
        tokens once the step has run); None if there are none. Call it before the step's forward: with
        `fill_on_thread` its fill starts now; read it after launching the forward (see `GrammarBitmask`)."""
        rows: list[tuple[str, GrammarState]] = []
        for req_id in so.num_scheduled_tokens:
            req = requests.get(req_id)
            st = req.structured_output if req is not None else None
            if st is not None and req.num_computed_tokens >= req.num_tokens:
                rows.append((req_id, st))
        if not rows:
            return None
        matchers = [st.matcher for _, st in rows]
        json_rows = [i for i, (_, st) in enumerate(rows) if st.spec.key[0] in ("json", "json_object")]
        on_thread = self.fill_on_thread and len(rows) >= _THREAD_FILL_MIN_ROWS
        if on_thread and self._fill_executor is None:
            self._fill_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-bitmask")
        return GrammarBitmask([r for r, _ in rows], partial(self._fill, matchers, json_rows),
                              self._fill_executor if on_thread else None,
                              None if self.pin_memory else self.vocab_size)   # a host sampler: unpack there too

    def _fill(self, matchers: list, json_rows: list[int]) -> torch.Tensor:
        """[len(matchers), ceil(vocab / 32)] int32: the packed bitmask of `matchers`' next tokens."""
        import xgrammar as xgr
        bitmask = torch.full((len(matchers), -(-self.vocab_size // 32)), -1, dtype=torch.int32,
                             pin_memory=self.pin_memory)
        if len(matchers) >= _BATCH_FILL_MIN_ROWS:          # xgrammar's threads fill the rows in parallel
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)
        if json_rows:
            # xgrammar (0.2.8) lets raw control characters into length-bounded strings, which JSON forbids
            # (json.loads refuses them); compact JSON needs none anywhere, so none are allowed
            bitmask[json_rows] &= self._no_control_bytes
        return bitmask

    def close(self) -> None:
        for ex in (self._executor, self._fill_executor):
            if ex is not None:
                ex.shutdown(wait=False, cancel_futures=True)
