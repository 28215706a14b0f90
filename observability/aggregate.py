"""One Prometheus view of many processes: each process's metrics as a plain snapshot (`snapshot_of`), the
snapshots of all an app's processes merged (`MetricsAggregate`: counters and histograms summed, gauges
kept while their process reports), and the merge written as Prometheus text with the vLLM aliases
(`render`). Pure: the Ray shell that carries the snapshots is app/metrics_hub.py."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from opentelemetry.sdk.metrics.export import Gauge, Histogram, MetricsData, Sum

from affinity_serve.observability.names import METRICS, VLLM_LABELS, Kind

Labels = tuple[tuple[str, str], ...]      # sorted (name, value) pairs
SeriesKey = tuple[str, Labels]            # (metric name, labels)


@dataclass(slots=True)
class Series:
    """One labelled series of a counter or gauge (`value`) or a histogram (`bounds`, per-bucket `counts`
    with one more entry than `bounds` for +Inf, `sum`, `count`)."""

    name: str
    labels: Labels
    value: float = 0.0
    bounds: tuple[float, ...] = ()
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def added(self, other: Series) -> Series:
        """This series plus `other` (same metric and labels): a counter's or histogram's sum."""
        if self.bounds != other.bounds:      # cannot happen for one spec; keep the newer shape
            return replace(other, counts=list(other.counts))
        return replace(self, value=self.value + other.value, sum=self.sum + other.sum,
                       count=self.count + other.count,
                       counts=[a + b for a, b in zip(self.counts, other.counts, strict=True)])


Snapshot = dict[SeriesKey, Series]


def snapshot_of(data: MetricsData | None) -> Snapshot:
    """The metrics named in observability/names.py from an OpenTelemetry reader's collection (cumulative)."""
    out: Snapshot = {}
    if data is None:
        return out
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name not in METRICS:
                    continue
                for p in m.data.data_points:
                    labels = tuple(sorted((str(k), str(v)) for k, v in (p.attributes or {}).items()))
                    if isinstance(m.data, Histogram):
                        s = Series(m.name, labels, bounds=tuple(p.explicit_bounds), counts=list(p.bucket_counts),
                                   sum=float(p.sum), count=int(p.count))
                    elif isinstance(m.data, (Sum, Gauge)):
                        s = Series(m.name, labels, value=float(p.value))
                    else:
                        continue
                    out[(m.name, labels)] = s
    return out


#: a process's gauges last until it has missed about this many pushes (when that is longer than gauge_ttl_s)
GAUGE_TTL_PUSHES = 3


@dataclass(slots=True)
class _Pushed:
    """A process's latest snapshot, when it came, and the process's push interval: as it declares it with each
    push, else as the hub sees it (its latest gap between pushes, or half its previous estimate if more: a
    one-off stall fades within a few pushes)."""

    seen: float
    snapshot: Snapshot
    interval_s: float = 0.0


class MetricsAggregate:
    """The latest snapshot of every process of one app, merged on demand.

    Counters and histograms are cumulative per process, so their sum over processes only grows while the
    processes live. A process that stops reporting keeps its gauges for `gauge_ttl_s`, or GAUGE_TTL_PUSHES of its
    push intervals if longer (then they vanish: a replica that left has no load; a process pushing less often
    than every `gauge_ttl_s`, `observability.metrics_push_interval_s` up to 60 s, keeps its gauges between its
    pushes); after `retire_after_s` its shared series (those without a `replica` label, e.g. an ingress's HTTP
    counts) are folded into a retired total so the sums never go back, and its own per-replica series are
    dropped (Prometheus sees a series end, not a counter reset).
    """

    def __init__(self, gauge_ttl_s: float = 5.0, retire_after_s: float = 300.0):
        self.gauge_ttl_s = gauge_ttl_s
        self.retire_after_s = retire_after_s
        self._processes: dict[str, _Pushed] = {}
        self._retired: Snapshot = {}

    def push(self, process: str, snapshot: Snapshot, now: float, interval_s: float | None = None) -> None:
        """The process's latest snapshot. A counter or histogram series it reported before and lacks now (an
        observable instrument's callback failed or skipped it this time) keeps its last value: its counts are
        cumulative while the process lives, and dropping them would take them out of the sums. `interval_s`:
        the process's own push interval, as it declares it (its gauges then last from its first push on, and
        pushes between timed ones, such as a /metrics scrape's, do not shorten it); without it the interval is
        estimated from the gaps between pushes."""
        prev = self._processes.get(process)
        declared = interval_s is not None and interval_s > 0
        if not declared:
            interval_s = 0.0
            if prev is not None:
                interval_s = max(now - prev.seen, prev.interval_s / 2)
        if prev is not None:
            kept = {k: s for k, s in prev.snapshot.items()
                    if k not in snapshot and METRICS[s.name].kind is not Kind.GAUGE}
            if kept:
                snapshot = {**snapshot, **kept}
        self._processes[process] = _Pushed(now, snapshot, interval_s)

    @property
    def num_processes(self) -> int:
        return len(self._processes)

    def merged(self, now: float) -> Snapshot:
        self._retire(now)
        out: Snapshot = dict(self._retired)
        for p in self._processes.values():
            fresh = now - p.seen <= max(self.gauge_ttl_s, GAUGE_TTL_PUSHES * p.interval_s)
            for key, s in p.snapshot.items():
                if METRICS[s.name].kind is Kind.GAUGE:
                    if fresh:
                        out[key] = s
                else:
                    out[key] = out[key].added(s) if key in out else s
        return out

    def _retire(self, now: float) -> None:
        for process, p in list(self._processes.items()):
            if now - p.seen <= self.retire_after_s:
                continue
            for key, s in p.snapshot.items():
                if METRICS[s.name].kind is not Kind.GAUGE and not any(k == "replica" for k, _ in s.labels):
                    self._retired[key] = self._retired[key].added(s) if key in self._retired else s
            del self._processes[process]


def render(snapshot: Snapshot, model_name: str | None = None, vllm_aliases: bool = True) -> str:
    """Prometheus text (format 0.0.4). Every series gets `model="<model_name>"` if it has no `model`
    label; with `vllm_aliases`, each metric that has vLLM names is written again under each of them, with
    the labels in VLLM_LABELS renamed (so vLLM's dashboards find `model_name`)."""
    by_name: dict[str, list[Series]] = {}
    for s in snapshot.values():
        by_name.setdefault(s.name, []).append(s)
    lines: list[str] = []
    for name, spec in METRICS.items():
        series = sorted(by_name.get(name, []), key=lambda s: s.labels)
        if not series:
            continue
        families = [(spec.family, {})] + ([(a, VLLM_LABELS) for a in spec.vllm] if vllm_aliases else [])
        for family, renames in families:
            exposed = family + ("_total" if spec.kind is Kind.COUNTER else "")
            lines.append(f"# HELP {exposed} {_escape_help(spec.description)}")
            lines.append(f"# TYPE {exposed} {spec.kind.value}")
            for s in series:
                labels = dict(s.labels)
                if model_name is not None:
                    labels.setdefault("model", model_name)
                labels = {renames.get(k, k): v for k, v in labels.items()}
                lines += _sample_lines(exposed, spec.kind, labels, s)
    return "\n".join(lines) + "\n"


def _sample_lines(exposed: str, kind: Kind, labels: dict[str, str], s: Series) -> list[str]:
    if kind is not Kind.HISTOGRAM:
        return [f"{exposed}{_labels(labels)} {_num(s.value)}"]
    out, running = [], 0
    for bound, n in zip([*s.bounds, math.inf], s.counts, strict=True):
        running += n
        out.append(f"{exposed}_bucket{_labels({**labels, 'le': _num(bound)})} {_num(running)}")
    out.append(f"{exposed}_sum{_labels(labels)} {_num(s.sum)}")
    out.append(f"{exposed}_count{_labels(labels)} {_num(s.count)}")
    return out


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _escape_value(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")
