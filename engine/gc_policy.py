"""Garbage-collector settings for a serving process: freeze the start-up heap, collect young objects rarely."""
from __future__ import annotations

import gc

#: Young-generation threshold for the step loop. A step allocates a few container objects per running
#: request (plan entries, sampled-token lists, deltas) that all die within the step. With CPython's
#: default (700) a 1024-request step triggers several young collections mid-step; they promote those
#: short-lived objects, and the promotions set off a full collection (tens of ms) every few dozen steps.
STEP_GEN0_THRESHOLD = 20_000


def tune_gc_for_serving() -> None:
    """Freeze everything alive now and let each step's short-lived objects die before a collection.

    gc.freeze() after start-up, as vLLM's engine core does: the model, the tokenizer and the KV block
    pool are never garbage, so full collections stop traversing them. Process-wide and idempotent;
    call it once the long-lived state is built. Leaves automatic collection off if it was off.
    """
    gc.collect()
    gc.freeze()
    gen0, gen1, gen2 = gc.get_threshold()
    if 0 < gen0 < STEP_GEN0_THRESHOLD:
        gc.set_threshold(STEP_GEN0_THRESHOLD, gen1, gen2)
