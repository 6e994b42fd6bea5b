"""Seeing what ran where: `dd.record()` captures the tasks of a computation, `timeline`
draws them as a pipeline diagram (one row per worker), `bubble_fraction` measures idle time.
"""
from __future__ import annotations

import collections
import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple

from dask.callbacks import Callback
from dask.utils import format_bytes
from distributed import get_task_stream

from ..cluster.info import current_client, slot_names
from ..core.keys import key_info
from ..errors import ArgumentError, KeyFormatError
from ..extras import available, require
from ..runtime import memory
from ..runtime.direct import compute_log
from ..runtime.live import is_live_action
from ..runtime.memory import MemorySample


__all__ = ["TaskRecord", "Recording", "record", "BubbleFraction", "PHASE_COLORS"]

#: colour per phase, shared by the timeline and the graph picture
PHASE_COLORS = {
    "F": "#4C9BE8", "B": "#E8804C", "I": "#F2B134", "W": "#7BC47F", "add": "#B39DDB",
    "grad": "#9E9E9E", "acc": "#9E9E9E", "loss": "#D81B60", "split": "#CFD8DC",
    "input": "#CFD8DC", "param": "#CFD8DC", "aux": "#F48FB1", "transfer": "#FFFFFF",
    "other": "#E0E0E0",
}
_BUSY = {"F", "B", "I", "W"}


class TaskRecord(NamedTuple):
    """One executed task (or a transfer, phase 'transfer') on one worker."""

    key: str
    worker: str
    start: float
    stop: float
    phase: str
    layer: str | None
    stage: int | None
    microbatch: int | None


class BubbleFraction(NamedTuple):
    """Idle share of the recorded window: overall and per worker (0 = always busy)."""

    overall: float
    per_worker: dict[str, float]


def _classify(key: Any) -> tuple[str, str | None, int | None, int | None]:
    try:
        info = key_info(key)
    except (KeyFormatError, TypeError):
        return "other", None, None, None
    return info.phase, info.layer, info.stage, info.microbatch


@dataclass
class Recording:
    """Tasks captured by `record`; times in seconds since the first task started."""

    tasks: list[TaskRecord] = field(default_factory=list)
    worker_names: dict[str, str] = field(default_factory=dict)
    #: per worker address ("local" without a cluster): the bytes it held, sampled at each
    #: layer task (`dagdiff.runtime.memory`), times on the tasks' axis
    memory: dict[str, list[MemorySample]] = field(default_factory=dict)

    def peak_memory(self) -> dict[str, int]:
        """Per worker address: the most bytes it held during the recorded step(s) (JAX
        device buffers + the NumPy arrays Dask and the programs hold), as sampled at
        each layer task; see `dagdiff.runtime.memory` for what is counted."""
        return {w: max(s.total for s in ss) for w, ss in self.memory.items() if ss}

    def memory_table(self) -> str:
        """Each worker's held bytes before the first task and at its peak, as text."""
        rows = [f"{'worker':<28} {'before':>10} {'peak':>10} {'device':>10} {'host':>10}"]
        for w in sorted(self.memory, key=lambda w: self.worker_names.get(w, w)):
            ss = self.memory[w]
            top = max(ss, key=lambda s: s.total)
            name = self.worker_names.get(w, w)
            rows.append(f"{name:<28} {format_bytes(ss[0].total):>10} {format_bytes(top.total):>10} "
                        f"{format_bytes(top.device):>10} {format_bytes(top.host):>10}")
        return "\n".join(rows)

    @property
    def workers(self) -> list[str]:
        """Worker rows in a stable order (by slot/stage when known)."""
        def order(w: str) -> tuple[int, str]:
            name = self.worker_names.get(w, w)
            digits = "".join(ch for ch in name if ch.isdigit())
            return (int(digits) if digits else 1 << 30, name)
        return sorted({t.worker for t in self.tasks}, key=order)

    def compute_tasks(self) -> list[TaskRecord]:
        return [t for t in self.tasks if t.phase != "transfer"]

    def makespan(self) -> float:
        ts = self.compute_tasks()
        return max(t.stop for t in ts) - min(t.start for t in ts) if ts else 0.0

    def bubble_fraction(self) -> BubbleFraction:
        """Idle share of the step on each worker and overall: 1 - busy / window, where busy
        is the time spent in forward/backward tasks (F, B, I, W) and the window runs from
        the first to the last of them on any worker."""
        busy = [t for t in self.tasks if t.phase in _BUSY]
        if not busy:
            return BubbleFraction(0.0, {})
        t0 = min(t.start for t in busy)
        t1 = max(t.stop for t in busy)
        window = max(t1 - t0, 1e-12)
        per: dict[str, float] = {}
        for w in self.workers:
            spans = sorted((t.start, t.stop) for t in busy if t.worker == w)
            per[self.worker_names.get(w, w)] = 1.0 - _union(spans) / window
        overall = sum(per.values()) / len(per) if per else 0.0
        return BubbleFraction(overall, per)

    def save_trace(self, path: str | None = None) -> dict[str, Any]:
        """Chrome trace-event JSON of the recording (opens in Perfetto, ui.perfetto.dev, or
        chrome://tracing): one track per worker (named by its slot when known), one
        slice per task with its phase, layer, stage and microbatch, transfers as slices
        of category ``transfer`` on the receiving worker's track. Writes it to `path` when
        given; returns the trace as a dict."""
        events: list[dict[str, Any]] = [
            {"ph": "M", "pid": 1, "tid": 0, "name": "process_name", "args": {"name": "dagdiff"}}]
        t0 = min((t.start for t in self.tasks), default=0.0)
        tids = {w: i + 1 for i, w in enumerate(self.workers)}
        for w, tid in tids.items():
            events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name",
                           "args": {"name": self.worker_names.get(w, w)}})
            events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_sort_index",
                           "args": {"sort_index": tid}})
        for t in sorted(self.tasks, key=lambda t: (tids[t.worker], t.start)):
            if t.phase in _BUSY and t.microbatch is not None:
                name = f"{t.phase}{t.microbatch} {t.layer}"
            elif t.phase == "transfer":
                name = f"transfer {t.key}"
            else:
                name = f"{t.phase} {t.layer or t.key}"
            events.append({
                "ph": "X", "pid": 1, "tid": tids[t.worker], "name": name, "cat": t.phase,
                "ts": round((t.start - t0) * 1e6, 3),
                "dur": round(max(t.stop - t.start, 0.0) * 1e6, 3),
                "args": {"key": t.key, "worker": t.worker, "layer": t.layer,
                         "stage": t.stage, "microbatch": t.microbatch}})
        bf = self.bubble_fraction()
        trace = {"traceEvents": events, "displayTimeUnit": "ms",
                 "otherData": {"makespan_s": self.makespan(), "bubble": bf.overall}}
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace

    def chart(self, title: str | None = None, width: int = 1000) -> Any:
        """An interactive timeline (a bokeh figure): one row per worker, one bar per task
        coloured by phase, hover for its key, layer, stage, microbatch, start and
        duration; pan and zoom along time; makespan and bubble in the title. Show it with
        ``bokeh.io.output_notebook(); bokeh.io.show(rec.chart())``, or `save_html`.
        Needs bokeh (``pip install dagdiff[viz]``)."""
        require("bokeh", "Recording.chart")
        from bokeh.models import ColumnDataSource, HoverTool
        from bokeh.plotting import figure

        rows = self.workers
        names = [str(self.worker_names.get(w, w)) for w in rows]
        t0 = min((t.start for t in self.tasks), default=0.0)
        cols: dict[str, list[Any]] = {k: [] for k in (
            "worker", "left", "right", "color", "phase", "layer", "stage", "microbatch",
            "key", "start_ms", "dur_ms")}
        for t in self.tasks:
            cols["worker"].append(str(self.worker_names.get(t.worker, t.worker)))
            cols["left"].append(t.start - t0)
            cols["right"].append(max(t.stop, t.start + 1e-6) - t0)
            cols["color"].append(PHASE_COLORS.get(t.phase, PHASE_COLORS["other"]))
            cols["phase"].append(t.phase)
            cols["layer"].append(t.layer or "")
            cols["stage"].append("" if t.stage is None else str(t.stage))
            cols["microbatch"].append("" if t.microbatch is None else str(t.microbatch))
            cols["key"].append(t.key)
            cols["start_ms"].append(round((t.start - t0) * 1e3, 3))
            cols["dur_ms"].append(round((t.stop - t.start) * 1e3, 3))
        bf = self.bubble_fraction()
        fig = figure(y_range=list(reversed(names)), width=width, height=60 + 40 * len(rows),
                     title=title or f"makespan {self.makespan():.3f} s, bubble {bf.overall:.1%}",
                     x_axis_label="time (s)", tools="xpan,xwheel_zoom,box_zoom,reset,save",
                     active_scroll="xwheel_zoom")
        fig.hbar(y="worker", left="left", right="right", height=0.8, fill_color="color",
                 line_color="black", line_width=0.3, source=ColumnDataSource(cols))
        fig.add_tools(HoverTool(tooltips=[
            ("task", "@key"), ("phase", "@phase"), ("layer", "@layer"), ("stage", "@stage"),
            ("microbatch", "@microbatch"), ("start", "@start_ms ms"),
            ("duration", "@dur_ms ms")]))
        return fig

    def __repr__(self) -> str:
        bf = self.bubble_fraction()
        return (f"<Recording: {len(self.compute_tasks())} tasks on {len(self.workers)} "
                f"worker(s), makespan {self.makespan():.3f} s, bubble {bf.overall:.1%}>")

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None
                          ) -> dict[str, Any]:
        """What Jupyter shows for ``rec`` in a cell: the interactive chart (BokehJS inline,
        so it works offline); the timeline PNG when bokeh is missing; text without either."""
        out: dict[str, Any] = {"text/plain": repr(self)}
        if not self.tasks:
            return out
        if available("bokeh"):
            from bokeh.embed import components
            from bokeh.resources import INLINE

            script, div = components(self.chart())
            out["text/html"] = INLINE.render_js() + script + div
        elif available("matplotlib"):
            import io

            import matplotlib
            matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt

            fig = self.timeline()
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=100)
            plt.close(fig)
            out["image/png"] = buf.getvalue()
        return out

    def save_html(self, path: str, title: str | None = None) -> str:
        """`chart` as a standalone HTML file (BokehJS inline: opens offline)."""
        require("bokeh", "Recording.save_html")
        from bokeh.embed import file_html
        from bokeh.resources import INLINE

        with open(path, "w") as f:
            f.write(file_html(self.chart(title), INLINE, title or "dagdiff timeline"))
        return path

    def timeline(self, path: str | None = None, title: str | None = None,
                 width: float = 12.0) -> Any:
        """Draw a per-worker Gantt chart (F/B/I/W blocks with microbatch numbers,
        transfers hatched); save to `path` if given. Returns the matplotlib Figure (needs
        matplotlib, the ``viz`` extra)."""
        matplotlib = require("matplotlib", "Recording.timeline")

        if path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        rows = self.workers
        fig, ax = plt.subplots(figsize=(width, 0.6 * len(rows) + 1.4))
        if not self.tasks:
            ax.text(0.5, 0.5, "no tasks recorded", ha="center", va="center")
        t0 = min((t.start for t in self.tasks), default=0.0)
        seen = set()
        for r, w in enumerate(rows):
            for t in self.tasks:
                if t.worker != w:
                    continue
                x, dx = t.start - t0, max(t.stop - t.start, 1e-6)
                color = PHASE_COLORS.get(t.phase, PHASE_COLORS["other"])
                hatch = "////" if t.phase == "transfer" else None
                ax.broken_barh([(x, dx)], (r - 0.4, 0.8), facecolors=color, edgecolor="black",
                               linewidth=0.3, hatch=hatch)
                seen.add(t.phase)
                if t.microbatch is not None and t.phase in _BUSY:
                    ax.text(x + dx / 2, r, str(t.microbatch), ha="center", va="center",
                            fontsize=7)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([self.worker_names.get(w, w) for w in rows])
        ax.invert_yaxis()
        ax.set_xlabel("time (s)")
        bf = self.bubble_fraction()
        ax.set_title(title or f"makespan {self.makespan():.3f} s, bubble {bf.overall:.1%}")
        order = [p for p in ("F", "B", "I", "W", "add", "grad", "loss", "transfer", "other")
                 if p in seen]
        ax.legend(handles=[Patch(facecolor=PHASE_COLORS[p], edgecolor="black", label=p,
                                 hatch="////" if p == "transfer" else None) for p in order],
                  loc="upper right", fontsize=7, ncol=len(order))
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=110)
            plt.close(fig)
        return fig


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@contextlib.contextmanager
def record(client: Any = None) -> Iterator[Recording]:
    """Capture every task computed inside the block.

    With a distributed client (given, or the current one) it wraps
    `distributed.get_task_stream` (workers named by their slot); otherwise it uses a
    Dask local-scheduler callback (rows are the scheduler's threads). Collect results
    inside the block (``dask.compute``, ``client.compute(...).result()``)."""
    c = client if client is not None else current_client()
    if c is not None and not hasattr(c, "submit") and hasattr(c, "scheduler_address"):
        c = _client_of(c)               # a cluster (dd.local_cluster()): its client
    if c is not None and not hasattr(c, "scheduler_info"):
        raise ArgumentError(f"dd.record takes a distributed Client (or nothing: the current one), "
                            f"got {type(c).__name__} {c!r}; e.g. dd.record(Client(address))")
    rec = Recording()
    if c is not None:
        _sampling(c, memory.start)
        try:
            with get_task_stream(c) as ts:
                yield rec
        finally:
            samples = _sampling(c, memory.stop)
        names = slot_names(c)
        rec.worker_names = dict(names)
        data = [d for d in ts.data if not is_live_action(d)]   # the programs' logs have them
        base = _from_stream(rec, data, _worker_times(c, data))
        rec.memory = {w: _shifted(ss, base) for w, ss in samples.items()}
        return

    lock = threading.Lock()
    starts: dict[Any, tuple[float, str]] = {}
    raw: list[tuple[Any, str, float, float]] = []

    def pretask(key: Any, dsk: Any, state: Any) -> None:
        with lock:
            starts[key] = (time.perf_counter(), threading.current_thread().name)

    def posttask(key: Any, result: Any, dsk: Any, state: Any, worker_id: Any) -> None:
        with lock:
            t, th = starts.pop(key, (time.perf_counter(), "main"))
            raw.append((key, th, t, time.perf_counter()))

    memory.start()
    try:
        with Callback(pretask=pretask, posttask=posttask):
            yield rec
    finally:
        samples = memory.stop()
    threads = sorted({th for _, th, _, _ in raw})
    rec.worker_names = {th: f"thread{i}" for i, th in enumerate(threads)}
    base = min((t for _, _, t, _ in raw), default=0.0)
    for key, th, t, u in raw:
        rec.tasks.append(TaskRecord(str(key), th, t - base, u - base, *_classify(key)))
    # samples carry wall-clock times, the tasks perf_counter ones
    rec.memory = {"local": _shifted(samples, base + time.time() - time.perf_counter())}


def _sampling(client: Any, fn: Any) -> dict[str, list[MemorySample]]:
    """`fn` (memory.start / memory.stop) on every worker; {} from workers that are gone."""
    try:
        out = client.run(fn, on_error="ignore")
    except Exception:                  # noqa: BLE001 - a worker went away
        return {}
    return {w: [MemorySample(*s) for s in ss] for w, ss in out.items()
            if isinstance(ss, list)}


def _shifted(samples: list[MemorySample], base: float) -> list[MemorySample]:
    return [s._replace(time=s.time - base) for s in samples]


def _worker_times(client: Any, data: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per worker address, what its process logged (`dagdiff.runtime.direct.runtime.DirectRuntime.compute_log`): the
    actions of direct-dispatch programs, and each task's start in one clock (the task
    stream's times jump with the workers' clock-offset estimates, which can swap
    neighbouring tasks)."""
    keys = sorted({d["key"] for d in data if isinstance(d.get("key"), str)})
    if not keys:
        return {}
    try:
        return client.run(compute_log, keys)
    except Exception:                  # a worker went away: keep the stream's times
        return {}


def _client_of(cluster: Any) -> Any:
    """The current client of `cluster`, or an `ArgumentError` saying to make one."""
    cur = current_client()
    address = getattr(getattr(cur, "scheduler", None), "address", None)
    if cur is not None and address == cluster.scheduler_address:
        return cur
    raise ArgumentError(
        f"dd.record takes a distributed Client, got the cluster {type(cluster).__name__} at "
        f"{cluster.scheduler_address} and no client of it is current; pass its client: "
        "client = distributed.Client(cluster); dd.record(client)")


def _from_stream(rec: Recording, data: list[dict[str, Any]],
                 logs: dict[str, dict[str, Any]] | None = None) -> float:
    """Rows of `rec` from task-stream records (returns the time base subtracted). A record comes when a task finishes and
    carries every start/stop its worker kept for that key, earlier runs of the same key
    too (a step computed a second time): each record adds only its own run, the last
    compute and the transfers after the compute before it. A direct-dispatch program's
    records in the recording are its worker's last runs of it, in order: the j-th of n
    shows the actions of run ``len(runs) - n + j``."""
    rows = []
    logs = logs or {}
    count = collections.Counter((d["worker"], d["key"]) for d in data
                                if d["key"] in logs.get(d["worker"], {}).get("programs", {}))
    seen: collections.Counter[tuple[str, Any]] = collections.Counter()
    for d in data:
        log = logs.get(d["worker"], {})
        programs, starts = log.get("programs", {}), log.get("starts", {})
        for ss in _own_run(d.get("startstops", ())):
            action = ss.get("action")
            if action == "compute" and d["key"] in programs:
                # a direct-dispatch program: a row per action of this run, on its worker
                runs = programs[d["key"]]
                wk = (d["worker"], d["key"])
                n = len(runs) - count[wk] + seen[wk]
                seen[wk] += 1
                if not 0 <= n < len(runs):
                    continue
                for key, start, stop in runs[n]:
                    rows.append((key, d["worker"], start, stop, *_classify(key)))
            elif action == "compute":
                known = starts.get(d["key"], [])
                n = _closest(ss["start"], known)
                start = known[n] if n is not None else ss["start"]
                rows.append((d["key"], d["worker"], start, start + ss["stop"] - ss["start"],
                             *_classify(d["key"])))
            elif action == "transfer":
                rows.append((d["key"], d["worker"], ss["start"], ss["stop"], "transfer",
                             None, None, None))
    if not rows:
        return 0.0
    base = min(r[2] for r in rows)
    for key, w, a, b, *info in rows:
        rec.tasks.append(TaskRecord(str(key), w, a - base, b - base, *info))
    return base


def _own_run(startstops: Any) -> list[dict[str, Any]]:
    """The start/stops of a task-stream record's own run: its last compute and the
    transfers between the compute before it and that one."""
    ss = list(startstops)
    computes = [i for i, s in enumerate(ss) if s.get("action") == "compute"]
    if not computes:
        return ss
    first = computes[-2] + 1 if len(computes) > 1 else 0
    return ss[first:computes[-1] + 1]


def _closest(t: float, times: list[float], within: float = 0.5) -> int | None:
    """The index of the time in `times` closest to `t` (None if none is `within` s)."""
    if not times:
        return None
    i = min(range(len(times)), key=lambda j: abs(times[j] - t))
    return i if abs(times[i] - t) <= within else None
