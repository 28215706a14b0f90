"""KVEventLog: an engine's KV cache events, numbered and kept in a bounded buffer for consumers that pull.

Torch-free and not thread-safe: AsyncLLMEngine fills it between steps and answers from it on the event
loop. Routers pull `since(next_seq, epoch)` on a timer and resync from a snapshot when told to.
"""
from __future__ import annotations

from collections import deque
from itertools import islice

from affinity_serve.engine.types import AllBlocksCleared, KVEvent, KVEventsReply


def num_event_blocks(event: KVEvent) -> int:
    """What an event costs the buffer: its block hashes (at least 1)."""
    return 1 if isinstance(event, AllBlocksCleared) else max(1, len(event.block_hashes))


class KVEventLog:
    """The latest events of the current cache epoch, numbered consecutively for the engine's life.

    Bounded by `max_blocks` block hashes (a BlockStored of a whole prompt counts each of its blocks), so
    memory is about `max_blocks` x 200 bytes whatever the mix; the oldest events are dropped first. An
    epoch change (restart, prefix-cache reset) empties the buffer: nobody can follow events across it.
    """

    def __init__(self, epoch: str, max_blocks: int):
        if max_blocks < 1:
            raise ValueError(f"the KV event buffer must hold >= 1 block, got {max_blocks}")
        self.epoch = epoch
        self.max_blocks = max_blocks
        self.next_seq = 0
        self._events: deque[KVEvent] = deque()
        self._weights: deque[int] = deque()
        self._num_blocks = 0

    @property
    def first_seq(self) -> int:
        """The number of the oldest event still held (== next_seq when none is)."""
        return self.next_seq - len(self._events)

    def __len__(self) -> int:
        return len(self._events)

    def append(self, epoch: str, events: list[KVEvent]) -> None:
        """Number and keep `events`, which happened in `epoch` (a new epoch drops the old one's events)."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._events.clear()
            self._weights.clear()
            self._num_blocks = 0
        for e in events:
            w = num_event_blocks(e)
            self._events.append(e)
            self._weights.append(w)
            self._num_blocks += w
        self.next_seq += len(events)
        while self._num_blocks > self.max_blocks and len(self._events) > 1:
            self._events.popleft()
            self._num_blocks -= self._weights.popleft()

    def since(self, next_seq: int, epoch: str | None = None, max_events: int | None = None) -> KVEventsReply:
        """Events numbered `next_seq` on (at most `max_events`), or `snapshot_required`.

        `epoch` is the one the asker's view belongs to; None skips that check (only safe for an asker that
        has not yet seen this engine: ask `kv_snapshot()` first instead).
        """
        lost = (epoch is not None and epoch != self.epoch) or not self.first_seq <= next_seq <= self.next_seq
        if lost:
            return KVEventsReply(self.epoch, self.next_seq, [], self.next_seq, snapshot_required=True)
        n = self.next_seq - next_seq
        newest_first = list(islice(reversed(self._events), n))      # O(n): the asker is usually close
        events = newest_first[::-1]
        if max_events is not None and len(events) > max_events:
            events = events[:max_events]
        return KVEventsReply(self.epoch, next_seq, events, next_seq + len(events), snapshot_required=False)
