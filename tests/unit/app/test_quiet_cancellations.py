"""Client disconnects are not server errors: the reports asyncio makes of the cancellations they cause are
dropped (app/serving.py quiet_cancelled_futures), on every loop of the process (Serve's replica loop, its
user-code loop and its router loop)."""
from __future__ import annotations

import asyncio


def test_a_cancellation_nobody_retrieved_is_not_reported_as_an_error(caplog):
    """A client that leaves cancels its replica calls; Ray sets TaskCancelledError on futures nobody awaits, and
    asyncio reported each as "Future exception was never retrieved" (an ERROR with a traceback)."""
    import gc

    from affinity_serve.app.serving import quiet_cancelled_futures

    class TaskCancelledError(Exception):       # Ray's, by name (Ray may be absent where this runs)
        pass

    loop = asyncio.new_event_loop()           # any loop: the filter is on asyncio's logger
    try:
        quiet_cancelled_futures()
        quiet_cancelled_futures()                    # once
        with caplog.at_level("ERROR", logger="asyncio"):
            for exc in (TaskCancelledError("cancelled"), RuntimeError("a real failure")):
                fut = loop.create_future()
                fut.set_exception(exc)
                del fut
                gc.collect()
        messages = [r.getMessage() for r in caplog.records]
        assert len(messages) == 1 and "never retrieved" in messages[0] and "a real failure" in caplog.text
    finally:
        loop.close()

