"""What `dd.record()` captured (`Recording`): the tasks of a computation per worker, their
pictures (`timeline`, the interactive `chart`, a Perfetto trace), `bubble_fraction` (idle
time) and the memory samples. How it is captured: `dagdiff.inspect.capture`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dask.utils import format_bytes

from ..core.keys import key_info
from ..errors import KeyFormatError
from ..extras import available, require
from ..runtime.memory import MemorySample


__all__ = ["TaskRecord", "Recording", "BubbleFraction", "ByWorker", "PHASE_COLORS",
           "classify"]

#: colour per phase, shared by the timeline and the graph picture
PHASE_COLORS = {
    "F": "#4C9BE8", "B": "#E8804C", "I": "#F2B134", "W": "#7BC47F", "add": "#B39DDB",
    "grad": "#9E9E9E", "acc": "#9E9E9E", "loss": "#D81B60", "split": "#CFD8DC",
    "input": "#CFD8DC", "param": "#CFD8DC", "aux": "#F48FB1", "transfer": "#FFFFFF",
    "other": "#E0E0E0",
}
_BUSY = {"F", "B", "I", "W"}
#: seconds a memory sample may come after the stop of the task that took it
_SAMPLE_SLACK = 0.005


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


class ByWorker(dict):  # type: ignore[type-arg]
    """A dict keyed by the workers' display names (their slots, ``slot0``), which also
    takes the names `Recording.workers` gives (addresses, threads)."""

    def __init__(self, items: Any = (), names: dict[str, str] | None = None) -> None:
        super().__init__(items)
        self._names = dict(names or {})

    def __missing__(self, key: str) -> Any:
        name = self._names.get(key)
        if name is None or name == key or not super().__contains__(name):
            raise KeyError(key)
        return self[name]

    def __contains__(self, key: object) -> bool:
        return super().__contains__(key) or (
            isinstance(key, str) and super().__contains__(self._names.get(key, key)))

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default


class BubbleFraction(NamedTuple):
    """Idle share of the recorded window: overall and per worker (0 = always busy),
    keyed by the workers' display names (a `Recording.workers` entry works too)."""

    overall: float
    per_worker: dict[str, float]


def classify(key: Any) -> tuple[str, str | None, int | None, int | None]:
    """A task key's (phase, layer, stage, microbatch); ("other", None, None, None) for a
    key dagdiff did not make."""
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

    def step_peaks(self) -> list[dict[str, int]]:
        """Per recorded step, in the order the steps started: each worker's most bytes
        while that step's tasks ran there (a step's tasks are told apart by the step
        token their keys end with). Steps in flight together share the samples of their
        overlap; `peak_memory` is the peak over all of them."""
        spans: dict[tuple[str, int], dict[str, list[float]]] = {}
        first: dict[tuple[str, int], float] = {}
        seen: dict[str, int] = {}
        acting: set[tuple[str, int]] = set()
        local = "local" in self.memory
        for t in sorted(self.tasks, key=lambda t: t.start):
            if t.phase in ("transfer", "other"):
                continue
            # a step's keys end with its token; a Trainer's replicas' actions with its
            # first 12 digits and the replica's number. The same key again is the same
            # step computed again (step.compute of one batch twice): another step
            key = str(t.key)
            run = seen[key] = seen.get(key, -1) + 1
            step = (key.rsplit("-", 1)[-1][:12], run)
            w = "local" if local else t.worker
            span = spans.setdefault(step, {}).setdefault(w, [t.start, t.stop])
            span[0], span[1] = min(span[0], t.start), max(span[1], t.stop)
            first[step] = min(first.get(step, t.start), t.start)
            if t.phase in _BUSY:
                acting.add(step)
        out = []
        # a step counts by its forward and backward actions: the tail of a step before
        # the recording (its loss task ending inside it) is no step of its own
        for token in sorted(acting, key=first.__getitem__):
            peaks = {}
            for w, (start, stop) in spans[token].items():
                # a task's sample is taken as it has its result, just after its stop
                held = [s.total for s in self.memory.get(w, ())
                        if start <= s.time <= stop + _SAMPLE_SLACK]
                if held:
                    peaks[w] = max(held)
            if peaks:
                out.append(peaks)
        return out

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
        return BubbleFraction(overall, ByWorker(per, self.worker_names))

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
        if order:                           # an empty recording draws no legend
            ax.legend(handles=[Patch(facecolor=PHASE_COLORS[p], edgecolor="black", label=p,
                                     hatch="////" if p == "transfer" else None)
                               for p in order],
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
