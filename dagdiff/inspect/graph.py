"""`dd.trace`: the traced forward + VJP graph of a call, as an object to look at - an HTML
table in Jupyter, a graphviz picture - without running anything."""
from __future__ import annotations

import html
import os
import re
import shutil
from collections import Counter, defaultdict
from typing import Any

import numpy as np

from ..build import Build
from ..core.keys import key_info
from ..core.tracer import Traced, fmt_aval
from ..errors import ArgumentError, MissingDependencyError
from ..extras import require
from .record import PHASE_COLORS
from .svg import graph_svg


#: graphs up to this many tasks show their picture inline in Jupyter (below the table)
INLINE_TASKS = 400


__all__ = ["TracedGraph", "INLINE_TASKS"]

_NODE = re.compile(r"-n(\d+)")


class TracedGraph:
    """What `dd.trace` returns: layers with stages, placement, shapes, parameter counts and
    task counts; `.loss`/`.grads` are the same Dask collections `dd.value_and_grad` gives."""

    def __init__(self, built: Build) -> None:
        self.build = built
        self.trace = built.model.trace
        self.targets = built.targets
        self.graph = built.graph
        self.microbatches = built.options.microbatches
        self.schedule = built.options.schedule
        out, self.grads = built.outputs()
        self.loss = out[0] if built.options.has_aux else out

    @property
    def dsk(self) -> dict[str, Any]:
        return dict(self.graph)

    def tasks_by_phase(self) -> Counter:
        """Number of tasks per phase (F, B, I, W, add, grad, ...)."""
        return Counter(key_info(k).phase for k in self.dsk)

    def rows(self) -> list[dict[str, Any]]:
        """One row per layer call: name, stage, where it runs, shapes, params, tasks."""
        per_node: dict[int, Counter] = defaultdict(Counter)
        for k in self.dsk:
            m = _NODE.search(k)
            if m:
                per_node[int(m.group(1))][key_info(k).phase] += 1
        out = []
        for n in self.trace.nodes:
            if n.kind != "call":
                continue
            ins, n_params = [], 0
            for x, kind in zip(n.in_leaves, n.spec.kinds):
                if kind != "d":
                    continue
                if isinstance(x, Traced):
                    src = self.trace.nodes[x.node]
                    if src.kind == "param":
                        n_params += int(np.prod(x.shape, dtype=np.int64))
                        continue
                    ins.append(fmt_aval(x.aval))
                else:
                    ins.append(fmt_aval(x))
            where = self.targets.target(n.stage)
            where = ("any" if where is None else
                     f"device {where}" if self.targets.kind == "devices" else str(where))
            tasks = per_node.get(n.index, Counter())
            out.append({"layer": n.name, "stage": n.stage, "where": where,
                        "inputs": ", ".join(ins) or "-",
                        "outputs": ", ".join(fmt_aval(a) for a in n.out_avals),
                        "params": n_params,
                        "tasks": " ".join(f"{p}:{c}" for p, c in sorted(tasks.items()))})
        return out

    def _repr_html_(self) -> str:
        head = ["layer", "stage", "worker/device", "inputs", "outputs", "params", "tasks"]
        cells = "".join(f"<th>{h}</th>" for h in head)
        body = []
        for r in self.rows():
            vals = [r["layer"], "-" if r["stage"] is None else r["stage"], r["where"],
                    r["inputs"], r["outputs"], f"{r['params']:,}", r["tasks"]]
            body.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in vals)
                        + "</tr>")
        counts = ", ".join(f"{p} {c}" for p, c in sorted(self.tasks_by_phase().items()))
        sched = (f"; {self.microbatches} microbatches, schedule "
                 f"{getattr(self.schedule, 'name', self.schedule)}" if self.schedule else "")
        picture = ""
        if len(self.dsk) <= INLINE_TASKS:    # the picture below the table (scrolls)
            picture = f'<div style="overflow:auto;max-height:480px">{self.svg()}</div>'
        return (f"<div><b>dagdiff graph</b>: {len(self.dsk)} tasks ({counts}){sched}"
                f"<table><thead><tr>{cells}</tr></thead><tbody>{''.join(body)}</tbody>"
                f"</table>{picture}</div>")

    def __repr__(self) -> str:
        lines = [f"TracedGraph({len(self.dsk)} tasks)"]
        for r in self.rows():
            lines.append(f"  {r['layer']:<20} stage={r['stage']} on {r['where']}: "
                         f"{r['inputs']} -> {r['outputs']} ({r['tasks']})")
        return "\n".join(lines)

    def to_graphviz(self, max_tasks: int = 2000) -> Any:
        """A `graphviz.Digraph`: one box per task coloured by phase (forward blue, VJP
        orange, ...), clustered by stage (needs the graphviz package, the ``viz`` extra)."""
        graphviz = require("graphviz", "TracedGraph.to_graphviz")

        dsk = self.dsk
        if len(dsk) > max_tasks:
            raise ArgumentError(f"the graph has {len(dsk)} tasks, more than max_tasks="
                                f"{max_tasks}; pass a larger max_tasks or trace a smaller call")
        g = graphviz.Digraph("dagdiff", graph_attr={"rankdir": "LR", "fontsize": "10"},
                             node_attr={"shape": "box", "style": "filled", "fontsize": "9"})
        by_stage: dict[Any, list[str]] = defaultdict(list)
        for k in dsk:
            by_stage[key_info(k).stage].append(k)
        for stage, keys in sorted(by_stage.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            target = g if stage is None else None
            ctx = g.subgraph(name=f"cluster_s{stage}") if stage is not None else None
            sub = ctx.__enter__() if ctx is not None else target
            if ctx is not None:
                where = self.targets.target(stage)
                sub.attr(label=f"stage {stage}" + (f" ({where})" if where is not None else ""),
                         style="rounded", color="gray")
            for k in keys:
                info = key_info(k)
                label = info.phase + (f" {info.layer}" if info.layer else "")
                if info.microbatch is not None:
                    label += f" m{info.microbatch}"
                sub.node(k, label=label, fillcolor=PHASE_COLORS.get(info.phase, "#E0E0E0"))
            if ctx is not None:
                ctx.__exit__(None, None, None)
        for k, task in dsk.items():
            for d in getattr(task, "dependencies", ()):
                if d in dsk:
                    g.edge(d, k)
        return g

    def svg(self, max_tasks: int = 2000) -> str:
        """The graph as SVG text, drawn by dagdiff (no graphviz needed): columns by
        dependency depth, a band per stage, boxes coloured by phase with the task key as
        tooltip; above `max_tasks` tasks, one box per (stage, phase, layer) with its count."""
        dsk = self.dsk
        deps = {k: [d for d in getattr(t, "dependencies", ()) if d in dsk]
                for k, t in dsk.items()}

        def label(stage: str) -> str:
            if stage == "None":
                return "no stage"
            where = self.targets.target(int(stage))
            return f"stage {stage}" + (f" ({where})" if where is not None else "")

        text, _ = graph_svg(deps, key_info, PHASE_COLORS, label, max_tasks)
        return text

    def visualize(self, path: str = "graph.svg", max_tasks: int = 2000) -> str:
        """Write the graph picture (format from the suffix). ``.svg`` is rendered with
        graphviz's ``dot`` when it is installed, else drawn by dagdiff itself (`svg`);
        ``.png``/``.pdf`` need ``dot``; ``.dot``/``.gv`` write the graphviz source. Graphs
        over `max_tasks` tasks are summarised per stage, phase and layer (drawn by
        dagdiff) instead of refused."""
        base, ext = os.path.splitext(path)
        fmt = ext.lstrip(".").lower() or "svg"
        big = len(self.dsk) > max_tasks
        if fmt == "svg" and (big or shutil.which("dot") is None):
            with open(path, "w") as f:
                f.write(self.svg(max_tasks))
            return path
        g = self.to_graphviz(max_tasks)
        if fmt in ("dot", "gv"):
            with open(path, "w") as f:
                f.write(g.source)
            return path
        if shutil.which("dot") is None:
            raise MissingDependencyError(
                f"rendering {fmt} needs the graphviz 'dot' program (apt-get install graphviz / "
                "conda install graphviz); visualize('graph.svg') draws the picture without it")
        return g.render(base, format=fmt, cleanup=True)
