"""Free TCP ports for servers a test starts in another process.

A port from the kernel's ephemeral range (`bind(("127.0.0.1", 0))`) is free when asked for, but by the time a
subprocess binds it, any process connecting out or binding port 0 may hold it (make test saw a CLI's dashboard
port taken so while the multi-node scenario's cluster ran beside it). Ports between Ray's worker ports
(10002-19999 by default) and Linux's ephemeral range (from 32768) are handed out by neither."""
from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32768
_given: set[int] = set()      # handed out by this process: two servers started together never share one


def free_port() -> int:
    """A port of 127.0.0.1 in [LOW, HIGH) that binds now and this process has not handed out before, drawn at
    random (so parallel test workers rarely meet)."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(LOW, HIGH)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in [{LOW}, {HIGH}) after 200 tries")
