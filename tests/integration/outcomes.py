"""What one HTTP completion request came to, judged whole: a stream counts as completed only when its last
chunk has a finish_reason and [DONE] follows with no in-band error event; a plain request by its body. The
elasticity and autoscaling integration tests use it to hold "zero failed requests" to that bar (a cut
stream still has status 200)."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    stream: bool
    start: float
    end: float = 0.0
    status: int | None = None
    replica: str | None = None
    payloads: list[str] = field(default_factory=list)      # SSE data payloads, or [the JSON body]
    transport_error: str | None = None

    @property
    def completed(self) -> bool:
        """200 and a whole response: a stream's last chunk has a finish_reason, then [DONE], no error event."""
        if self.status != 200 or self.transport_error:
            return False
        if not self.stream:
            return json.loads(self.payloads[0])["choices"][0]["finish_reason"] == "length"
        if len(self.payloads) < 2 or self.payloads[-1] != "[DONE]":
            return False
        objs = [json.loads(p) for p in self.payloads[:-1]]
        return not any("error" in o for o in objs) and objs[-1]["choices"][0]["finish_reason"] == "length"

    @property
    def error_event(self) -> dict | None:
        """The in-band error of a stream that ended with one, followed by [DONE]; else None."""
        if self.stream and self.status == 200 and len(self.payloads) >= 2 and self.payloads[-1] == "[DONE]":
            last = json.loads(self.payloads[-2])
            return last.get("error")
        return None


def send(c: httpx.Client, url: str, prompt: list[int], max_tokens: int, stream: bool,
             first_chunk: threading.Event | None = None) -> Outcome:
    o = Outcome(stream, time.monotonic())
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    try:
        if stream:
            with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                o.status = r.status_code
                if r.status_code != 200:
                    o.payloads = [r.read().decode()]
                for line in r.iter_lines() if r.status_code == 200 else ():
                    if line.startswith("data: "):
                        o.payloads.append(line[6:])
                        if o.replica is None and o.payloads[-1] != "[DONE]":
                            o.replica = json.loads(o.payloads[-1]).get("system_fingerprint")
                            if first_chunk is not None:
                                first_chunk.set()
        else:
            r = c.post(f"{url}/v1/completions", json=body)
            o.status, o.payloads = r.status_code, [r.text]
            o.replica = r.json().get("system_fingerprint") if r.status_code == 200 else None
            if r.status_code == 503:
                o.payloads.append(r.headers.get("retry-after", ""))
    except Exception as e:        # noqa: BLE001 - a reset or a timeout is what the test must not see
        o.transport_error = repr(e)
    o.end = time.monotonic()
    return o
