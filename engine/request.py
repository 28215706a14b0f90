"""Request: one generation's state inside the engine (tokens, progress, status, block hashes)."""
from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from affinity_serve.engine.hashing import BlockHash, hash_block_chain
from affinity_serve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from affinity_serve.engine.structured_output.grammar import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    #: its prefix's KV is being loaded from a KV connector's tier: not running, no token budget
    WAITING_FOR_KV = "waiting_for_kv"
    #: its grammar (structured output) is compiling on the engine's worker thread: not queued, no token budget
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> "FinishReason | None":
        return _FINISH_REASON.get(self)


class FinishReason(str, enum.Enum):
    """OpenAI-style finish reasons."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Mutable per-request state owned by the scheduler.

    Every request has `num_tokens` (prompt + output so far) and `num_computed_tokens` (tokens whose KV
    is in the cache); each step the scheduler lets computed tokens catch up. `block_hashes` holds the
    hash of every *full* block of known tokens and grows as output tokens arrive.
    """

    __slots__ = ("req_id", "prompt_token_ids", "sampling_params", "eos_token_id", "arrival_time",
                 "priority", "cache_salt", "all_token_ids", "num_prompt_tokens", "num_output_tokens",
                 "num_computed_tokens", "num_cached_tokens", "status", "stop_reason", "block_hashes",
                 "num_preemptions", "_block_size", "trace_context", "num_tokens",
                 "first_scheduled_time", "structured_output", "kv_transfer", "num_transferred_tokens",
                 "kv_wait_s", "kv_wait_mark")

    def __init__(self, req_id: str, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                 *, eos_token_id: int | None = None, arrival_time: float | None = None,
                 priority: int = 0, cache_salt: str | None = None, block_size: int = 16,
                 trace_context: dict[str, str] | None = None, block_hashes: list[BlockHash] | None = None):
        self.req_id = req_id
        # kept by reference (EngineRequest's contract: the caller no longer changes it); all_token_ids grows
        self.prompt_token_ids = prompt_token_ids if isinstance(prompt_token_ids, list) else list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.trace_context = trace_context
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        #: prompt + output tokens so far (kept as a field: read on every step's hot path)
        self.num_tokens = self.num_prompt_tokens
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        #: prefix-cache hit at first admission (None until admitted): reported as cached tokens.
        self.num_cached_tokens: int | None = None
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        #: the grammar every output token must follow (set by the engine; this sequence's own matcher)
        self.structured_output: GrammarState | None = None
        #: P/D disaggregation (engine.kv_connector.pd): a RemoteDecode (prefill here, hold the KV) or a
        #: RemotePrefill (read a prefill engine's KV), set by the engine; None otherwise
        self.kv_transfer: object | None = None
        #: prompt tokens read from a prefill engine that it computed for this request (not cache hits there):
        #: admitted as local hits, but not reported as cached
        self.num_transferred_tokens = 0
        #: seconds it waited in the queue while the queue could not move for want of KV blocks (no blocks for
        #: its head and no prompt tokens running, or a preemption), summed over its admissions (a preempted
        #: request's wait to resume counts too); set by the scheduler, which keeps `kv_wait_mark` (its
        #: KV-blocked clock when the request joined the queue)
        self.kv_wait_s = 0.0
        self.kv_wait_mark = 0.0
        self._block_size = block_size
        # `block_hashes` lets sibling sequences (n > 1) share one hashing of the same prompt
        self.block_hashes: list[BlockHash] = (list(block_hashes) if block_hashes is not None
                                              else hash_block_chain(self.all_token_ids, block_size, cache_salt))

    @property
    def block_size(self) -> int:
        """The block size `block_hashes` were computed with (must be the KV cache's)."""
        return self._block_size

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.num_output_tokens += 1
        self.num_tokens = n = self.num_tokens + 1
        if n % self._block_size == 0:
            self.hash_new_full_blocks()

    def hash_new_full_blocks(self) -> None:
        """Extend `block_hashes` over blocks that became full since the last call."""
        start = len(self.block_hashes)
        parent = self.block_hashes[-1] if start else None
        self.block_hashes.extend(hash_block_chain(self.all_token_ids, self._block_size, self.cache_salt,
                                                  parent, start))

    def __repr__(self) -> str:
        return (f"Request({self.req_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
