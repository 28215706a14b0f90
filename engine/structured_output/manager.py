"""The structured-output manager: grammars compiled off the step loop (xgrammar), cached by spec, one matcher
per sequence, and the token bitmask each step applies to its constrained rows."""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from affinity_serve.engine.sampler import needs_mask_first
from affinity_serve.engine.structured_output.grammar import GrammarBitmask, GrammarState
from affinity_serve.engine.structured_output.spec import StructuredOutputSpec, import_xgrammar
from affinity_serve.engine.structured_output.utf8 import NUM_STATES, REJECT, Utf8Tables

if TYPE_CHECKING:
    from affinity_serve.engine.request import Request
    from affinity_serve.engine.types import SchedulerOutput

#: compiled grammars kept (least recently used dropped first)
_CACHE_SIZE = 512
#: compiles run at once: a slow one (a 20,000-string choice takes ~30 s) does not hold up the small ones behind it
COMPILE_THREADS = 2
#: from this many constrained rows a step fills the bitmask in one call of xgrammar's batch matcher
_BATCH_FILL_MIN_ROWS = 8
#: a batch fill expected to take longer than this (the time a row x rows) may use xgrammar's threads, and
#: does where they measured faster a row than the calling thread alone: waking them costs ~70 us, and where
#: torch's threads hold the cores they lose (2 shared cores, 32 rows: 0.54-1.1 ms against 0.2 ms alone)
_THREADED_FILL_MIN_S = 200e-6
#: the time a row of the mode in use is a moving average of this weight; the other mode is tried again every
#: _FILL_PROBE_EVERY batch fills (the machine's load changes), and that fill's time replaces its own
_FILL_EMA = 0.25
_FILL_PROBE_EVERY = 64
_clock = time.perf_counter          # the fills' timer (a test sets it)
#: from this many, with fill_on_thread, on the worker thread (fewer fill in less than the hand-off costs)
_THREAD_FILL_MIN_ROWS = 4


def _tokenizer_size(tokenizer: Any) -> int:
    """One more than the tokenizer's largest id (added tokens included)."""
    return max(tokenizer.get_vocab().values()) + 1


def _low_bits(n: int) -> int:
    """An int32 word with bits 0..n-1 set (all 32 for n == 0: a full last word)."""
    word = (1 << n) - 1 if n else 0xFFFFFFFF
    return word - 2**32 if word >= 2**31 else word


def _pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """[vocab] bool -> [ceil(vocab / 32)] int32 words (bit j of word w: token 32w + j), as xgrammar packs."""
    n = -(-allowed.shape[0] // 32) * 32
    bits = torch.zeros(n, dtype=torch.int64)
    bits[:allowed.shape[0]] = allowed.long()
    words = (bits.view(-1, 32) << torch.arange(32, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class StructuredOutputManager:
    """Owned by the engine: compiles grammars on one worker thread, caches them by spec, builds each step's
    bitmask on another. `tokenizer` is the engine's (Hugging Face) tokenizer, `vocab_size` the logits' width,
    `stop_token_ids` the ids that end a sequence (a finished grammar allows only these). `fill_on_thread`:
    each step's bitmask is filled on a worker thread from the moment the step is scheduled; otherwise when the
    sampler reads it (see `GrammarBitmask`); a step with fewer than `_THREAD_FILL_MIN_ROWS` constrained rows
    fills when read either way. `pin_memory`: the bitmask is filled in pinned host memory (it
    crosses to a CUDA device without a staging copy). `check_first` (host sampling): a step whose constrained
    rows sample greedily or by temperature alone (no top-k, top-p, min-p) fills nothing ahead; the sampler asks
    each constrained row's matcher whether it allows the row's unmasked winner (its argmax, or its race's) and
    fills the rows it does not allow alone (see `TokenMask`)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], *,
                 fill_on_thread: bool = False, pin_memory: bool = False, check_first: bool = True):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.fill_on_thread = fill_on_thread
        self.pin_memory = pin_memory
        self.check_first = check_first
        self._executor: ThreadPoolExecutor | None = None
        self._fill_executor: ThreadPoolExecutor | None = None
        self._compiler = None                       # built on a worker thread by the first compile
        self._compiler_lock = threading.Lock()
        #: the ids xgrammar's matchers cover: the tokenizer's (and the stop ids). A model's logits are often
        #: wider (padded to a multiple of 64 or more; the demo benchmark's 32,000 over 730 tokens); xgrammar
        #: would count the padding as special tokens and clear each one's bit every fill (~1 us per 1,000 ids a
        #: row), while they are simply never allowed: their words stay 0 (see _fill). Set with the compiler
        #: (no tokenizer, skip_tokenizer_init: no grammar is accepted, so none is ever compiled)
        self._fill_vocab_size = vocab_size
        #: the tokens each row may take next and keep its output valid UTF-8 (and, in JSON, free of control
        #: bytes); built with the compiler, shared with every GrammarState (see _fill and utf8.py)
        self._utf8 = Utf8Tables()
        self._control_byte_ids: frozenset[int] = frozenset()     # tokens holding a control byte, as ids
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._batch_matchers: dict[int, Any] = {}  # xgrammar's BatchGrammarMatcher by its thread count
        #: a fill's time a row (moving average) with xgrammar's threads (True) and without (False)
        self._fill_s_per_row: dict[bool, float | None] = {False: None, True: None}
        self._num_batch_fills = 0
        self._last_fill_threaded = False
        #: the last filled word's bits for ids below _fill_vocab_size (xgrammar may set the others)
        self._tail_word = -1
        self.num_compiles = 0
        self.num_cache_hits = 0

    def new_state(self, spec: StructuredOutputSpec, prefix: tuple[int, ...] = ()) -> GrammarState:
        """A sequence's grammar state; its compile starts now (or is the cached one). `prefix`: output tokens
        sampled under this grammar elsewhere (P/D: the prefill engine's first token), which its matcher takes
        before any sampled here."""
        return GrammarState(spec, self._compile(spec), prefix, self._utf8)

    def _compile(self, spec: StructuredOutputSpec) -> Future:
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return fut
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=COMPILE_THREADS, thread_name_prefix="grammar-compile")
            fut = self._executor.submit(self._compile_now, key)
            self._cache[key] = fut
            self.num_compiles += 1
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return fut

    def _compile_now(self, key: tuple[str, str]):
        """On a worker thread: the token-level compile (xgrammar's adaptive token mask cache)."""
        with self._compiler_lock:
            if self._compiler is None:
                self._build_compiler()
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

    def _build_compiler(self) -> None:
        """Once, on the first compile's thread (under `_compiler_lock`): xgrammar's compiler over this vocabulary."""
        xgr = import_xgrammar()
        self._fill_vocab_size = min(self.vocab_size,
                                    max([_tokenizer_size(self.tokenizer) - 1, *self.stop_token_ids]) + 1)
        self._tail_word = _low_bits(self._fill_vocab_size % 32)
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self._fill_vocab_size,
                                                  stop_token_ids=self.stop_token_ids)
        self._utf8.build(info.decoded_vocab, self.vocab_size, self.stop_token_ids)
        self._control_byte_ids = self._utf8.control_byte_ids
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)     # last: set means the fields above are

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
        req_ids: list[str] = []
        states: list[GrammarState] = []
        json_rows: list[int] = []
        ask = self.check_first and not self.pin_memory
        for req_id in so.num_scheduled_tokens:
            req = requests.get(req_id)
            st = req.structured_output if req is not None else None
            if st is not None and req.num_computed_tokens >= req.num_tokens:
                if st._ahead is not None:       # a kept token whose output was dropped: undo it
                    st.settle()
                if st.is_json:
                    json_rows.append(len(states))
                req_ids.append(req_id)
                states.append(st)
                if ask and needs_mask_first(req.sampling_params):
                    ask = False
        if not states:
            return None
        matchers = [st._matcher if st._matcher is not None else st.matcher for st in states]
        utf8 = [st._utf8 for st in states]          # (after `matcher`: a P/D prefix is taken there)
        # a host sampler whose constrained rows are greedy or draw by temperature alone: most rows' winner is
        # allowed, so ask first and fill only the rest (a row with top-k/top-p/min-p reads its whole mask)
        check = _StepRows(self, states, json_rows) if ask else None
        on_thread = self.fill_on_thread and len(states) >= _THREAD_FILL_MIN_ROWS and check is None
        if on_thread and self._fill_executor is None:
            self._fill_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-bitmask")
        return GrammarBitmask(req_ids, partial(self._fill, matchers, json_rows, utf8),
                              self._fill_executor if on_thread else None,
                              None if self.pin_memory else self.vocab_size,   # a host sampler: unpack there too
                              check)

    def _fill(self, matchers: list, json_rows: list[int], utf8: Sequence[int] | None = None) -> torch.Tensor:
        """[len(matchers), ceil(vocab / 32)] int32: the packed bitmask of `matchers`' next tokens, where
        `utf8[i]` is row i's output's UTF-8 state (see utf8.py; None: all at a character's start)."""
        num_words = -(-self.vocab_size // 32)
        fill_words = -(-self._fill_vocab_size // 32)
        padded = self._fill_vocab_size < self.vocab_size
        bitmask = torch.full((len(matchers), num_words), 0 if padded else -1, dtype=torch.int32,
                             pin_memory=self.pin_memory)
        # xgrammar wants exactly its vocabulary's width: a narrower buffer where the logits are padded
        target = torch.empty((len(matchers), fill_words), dtype=torch.int32) if padded else bitmask
        t0 = _clock()
        threaded = False
        if len(matchers) >= _BATCH_FILL_MIN_ROWS:           # one call for the batch
            threaded = self._use_threads(len(matchers))
            self._batch_matcher(threaded).batch_fill_next_token_bitmask(matchers, target)
        else:
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(target, i)
        s_per_row = (_clock() - t0) / len(matchers)
        # the mode in use is averaged; a probe of the other replaces its stale time
        last = self._fill_s_per_row[threaded] if threaded == self._last_fill_threaded else None
        self._fill_s_per_row[threaded] = s_per_row if last is None else last + _FILL_EMA * (s_per_row - last)
        self._last_fill_threaded = threaded
        if padded:
            target[:, -1] &= self._tail_word
            bitmask[:, :fill_words] = target
        # xgrammar (0.2.9) takes a UTF-16 surrogate's bytes for a character (in a JSON string, a regex's `.`):
        # each row keeps only the tokens that leave its output valid UTF-8; and it lets raw control characters
        # into length-bounded strings, which JSON forbids (json.loads refuses them), while compact JSON needs
        # none anywhere: JSON rows allow none. One row of the precomputed masks a row, ANDed in
        masks = self._utf8.masks
        rows = list(utf8) if utf8 is not None else [0] * len(matchers)
        for r in json_rows:
            rows[r] += NUM_STATES
        first = rows[0]
        if rows.count(first) == len(rows):          # the usual step: every row at a character's start, one kind
            bitmask &= masks[first]
        else:                                       # in place, row by row (no gathered copy): ~2 us a row at 150k
            out, table = bitmask.numpy(), masks.numpy()
            for i, r in enumerate(rows):
                np.bitwise_and(out[i], table[r], out=out[i])
        return bitmask

    def _use_threads(self, num_rows: int) -> bool:
        """Whether this batch fill uses xgrammar's threads: only a slow fill, and then the mode measured faster
        a row (threads tried once first, and the mode not in use every _FILL_PROBE_EVERY fills)."""
        alone, threaded = self._fill_s_per_row[False], self._fill_s_per_row[True]
        self._num_batch_fills += 1
        if alone is None or alone * num_rows <= _THREADED_FILL_MIN_S or (os.cpu_count() or 1) < 2:
            return False
        if threaded is None:
            return True
        faster = threaded < alone
        return faster != (self._num_batch_fills % _FILL_PROBE_EVERY == 0)

    def _batch_matcher(self, threaded: bool):
        """xgrammar's batch matcher: with its threads (up to 8), or filling on the calling thread."""
        import xgrammar as xgr
        num_threads = min(8, os.cpu_count() or 1) if threaded else 1
        m = self._batch_matchers.get(num_threads)
        if m is None:
            m = self._batch_matchers[num_threads] = xgr.BatchGrammarMatcher(max_threads=num_threads)
        return m

    def _allows(self, matcher, token_id: int, is_json: bool, utf8: int = 0) -> bool:
        """Whether `matcher` takes `token_id` next, as its filled bitmask would say (the matcher is left as it
        was): ids past the tokenizer, tokens that would make the output (in UTF-8 state `utf8`) invalid UTF-8
        and, in JSON, tokens with a control byte never (see _fill)."""
        if (token_id >= self._fill_vocab_size or (is_json and token_id in self._control_byte_ids)
                or self._utf8.next_rows[utf8][token_id] == REJECT):
            return False
        if not matcher.accept_token(token_id):
            return False
        matcher.rollback(1)
        return True

    def _ask(self, states: Sequence[GrammarState], json_rows: frozenset[int], rows: Sequence[int],
             token_ids: Sequence[int], keep: bool) -> list[bool]:
        """`_allows` for many rows in one loop (row rows[k] of `states` asked about token_ids[k]); with `keep` a
        matcher that allows its token keeps it (`GrammarState.accept` of that token then only confirms it)."""
        limit, control, utf8 = self._fill_vocab_size, self._control_byte_ids, self._utf8.next_rows
        out = []
        for i, t in zip(rows, token_ids):
            st = states[i]
            if t >= limit or (t in control and i in json_rows) or utf8[st._utf8][t] == REJECT:
                out.append(False)
                continue
            m = st._matcher if st._matcher is not None else st.matcher
            if not m.accept_token(t):
                out.append(False)
            elif keep:
                st._ahead = t
                out.append(True)
            else:
                m.rollback(1)
                out.append(True)
        return out

    def close(self) -> None:
        for ex in (self._executor, self._fill_executor):
            if ex is not None:
                ex.shutdown(wait=False, cancel_futures=True)


class _StepRows:
    """A step's constrained rows (row i: states[i]) for `TokenMask`: tokens asked of single rows' matchers
    (kept where allowed, if asked to), or some rows' bitmask filled alone."""

    __slots__ = ("_json_rows", "_kept", "_manager", "_states")

    def __init__(self, manager: StructuredOutputManager, states: list[GrammarState], json_rows: list[int]):
        self._manager = manager
        self._states = states
        self._json_rows = frozenset(json_rows)
        self._kept: list[int] = []

    def allows(self, rows: Sequence[int], token_ids: Sequence[int], keep: bool = False) -> list[bool]:
        out = self._manager._ask(self._states, self._json_rows, rows, token_ids, keep)
        if keep:
            self._kept += [i for i, ok in zip(rows, out) if ok]
        return out

    @property
    def num_ids(self) -> int:
        return self._manager._fill_vocab_size

    def release(self) -> None:
        for i in self._kept:
            self._states[i].settle()
        self._kept = []

    def fill(self, rows: Sequence[int]) -> torch.Tensor:
        for i in rows:                          # (a row that kept a token is settled, so never filled)
            self._states[i].settle()
        return self._manager._fill([self._states[i].matcher for i in rows],
                                   [k for k, i in enumerate(rows) if i in self._json_rows],
                                   [self._states[i]._utf8 for i in rows])
