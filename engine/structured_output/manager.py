"""The structured-output manager: grammars compiled off the step loop (xgrammar), cached by spec, one matcher
per sequence, and the token bitmask each step applies to its constrained rows."""
from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.structured_output.spec import StructuredOutputSpec, import_xgrammar

if TYPE_CHECKING:
    from engine.request import Request
    from engine.types import SchedulerOutput

#: compiled grammars kept (least recently used dropped first)
_CACHE_SIZE = 512
#: from this many constrained rows a step fills the bitmask with xgrammar's batch matcher (threads)
_BATCH_FILL_MIN_ROWS = 8


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
        for t in token_ids:
            if m.is_terminated() or not m.accept_token(t):
                return False
        return True

    @property
    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()


@dataclass(slots=True)
class GrammarBitmask:
    """The step's allowed tokens for its constrained sampling rows: `bitmask` row i (int32 words, bit j of word
    w allows token 32w + j) belongs to `req_ids[i]`."""

    req_ids: list[str]
    bitmask: torch.Tensor                # [len(req_ids), ceil(vocab / 32)] int32, on the host

    def token_mask(self, row_req_ids: Sequence[str], vocab_size: int, device: torch.device) -> torch.Tensor | None:
        """[len(row_req_ids), vocab_size] bool, True where allowed (rows without a grammar all True); None if
        no row is constrained."""
        index = {r: i for i, r in enumerate(self.req_ids)}
        hits = [(j, index[r]) for j, r in enumerate(row_req_ids) if r in index]
        if not hits:
            return None
        packed = self.bitmask
        if len(hits) != len(row_req_ids) or any(j != i for j, i in hits):
            packed = torch.full((len(row_req_ids), self.bitmask.shape[1]), -1, dtype=torch.int32)   # all allowed
            packed[[j for j, _ in hits]] = self.bitmask[[i for _, i in hits]]
        if device.type == "cuda":          # the packed words cross (32x smaller), the device unpacks them
            packed = packed.pin_memory().to(device, non_blocking=True)
        return unpack_bitmask(packed, vocab_size)


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
    table = _BIT_TABLES.get(bitmask.device)
    if table is None:
        b = torch.arange(256, dtype=torch.int32)
        table = ((b[:, None] >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(bitmask.device)   # [256, 8]
        _BIT_TABLES[bitmask.device] = table
    as_bytes = bitmask.contiguous().view(torch.uint8)                                   # [R, 4W]
    return table[as_bytes.long()].reshape(bitmask.shape[0], -1)[:, :vocab_size]


class StructuredOutputManager:
    """Owned by the engine: compiles grammars on one worker thread, caches them by spec, builds each step's
    bitmask. `tokenizer` is the engine's (Hugging Face) tokenizer, `vocab_size` the logits' width,
    `stop_token_ids` the ids that end a sequence (a finished grammar allows only these)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._executor: ThreadPoolExecutor | None = None
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
        tokens once the step has run); None if there are none."""
        rows: list[tuple[str, GrammarState]] = []
        for req_id in so.num_scheduled_tokens:
            req = requests.get(req_id)
            st = req.structured_output if req is not None else None
            if st is not None and req.num_computed_tokens >= req.num_tokens:
                rows.append((req_id, st))
        if not rows:
            return None
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        matchers = [st.matcher for _, st in rows]
        if len(rows) >= _BATCH_FILL_MIN_ROWS:          # xgrammar's threads fill the rows in parallel
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=min(8, os.cpu_count() or 1))
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)
        json_rows = [i for i, (_, st) in enumerate(rows) if st.spec.key[0] in ("json", "json_object")]
        if json_rows:
            # xgrammar (0.2.8) lets raw control characters into length-bounded strings, which JSON forbids
            # (json.loads refuses them); compact JSON needs none anywhere, so none are allowed
            bitmask[json_rows] &= self._no_control_bytes
        return GrammarBitmask([r for r, _ in rows], bitmask)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
