"""The traced task graph as an SVG drawn here, with no graphviz binary: a layered layout
(columns by dependency depth, one band per stage), boxes coloured by phase, a tooltip per
task; large graphs summarised as one box per (stage, phase, layer)."""
from __future__ import annotations

import collections
from html import escape
from typing import Any, Callable, Mapping

from ..core.dag import topological


__all__ = ["graph_svg"]

_W, _H = 150, 22          # box size
_DX, _DY = 190, 30        # column and row pitch
_PAD = 30


def graph_svg(deps: Mapping[str, Any], info: Callable[[str], Any],
              colors: Mapping[str, str], stage_label: Callable[[Any], str],
              max_tasks: int = 2000) -> tuple[str, int]:
    """SVG text of the graph `deps` (key -> dependencies inside it) and the number of boxes
    drawn. `info(key)` gives the key's KeyInfo (phase, layer, stage, microbatch); above
    `max_tasks` tasks each (stage, phase, layer) group becomes one box with its count."""
    keys = list(deps)
    summary = len(keys) > max_tasks
    task_depth: dict[str, int] = {}
    for k in topological({k: [d for d in deps[k] if d in deps] for k in keys}):
        task_depth[k] = 1 + max((task_depth[d] for d in deps[k] if d in deps), default=-1)
    if summary:
        group = {k: _group(info(k)) for k in keys}
        members = collections.Counter(group.values())
        gdeps: dict[str, set[str]] = {g: set() for g in members}
        for k in keys:
            for d in deps[k]:
                if d in group and group[d] != group[k]:
                    gdeps[group[k]].add(group[d])
        nodes = {g: _label_of_group(g, members[g]) for g in members}
        stage_of = {g: g.split("|")[0] for g in members}
        phase_of = {g: g.split("|")[1] for g in members}
        edges = {g: sorted(ds) for g, ds in gdeps.items()}
        tips = {g: f"{members[g]} tasks: {_label_of_group(g, members[g])}" for g in members}
    else:
        nodes, stage_of, phase_of, tips = {}, {}, {}, {}
        for k in keys:
            i = info(k)
            label = i.phase + (f" {i.layer}" if i.layer else "")
            if i.microbatch is not None:
                label += f" m{i.microbatch}"
            nodes[k], stage_of[k], phase_of[k], tips[k] = label, str(i.stage), i.phase, k
        edges = {k: [d for d in deps[k] if d in deps] for k in keys}
    if summary:   # a group sits at its earliest member's column (groups may form cycles)
        depth: dict[str, int] = {}
        for k in keys:
            g = group[k]
            depth[g] = min(depth.get(g, 1 << 30), task_depth[k])
        ranks = {d: i for i, d in enumerate(sorted(set(depth.values())))}
        depth = {g: ranks[d] for g, d in depth.items()}
    else:
        depth = task_depth
    stages = sorted(set(stage_of.values()), key=lambda s: (s == "None", int(s) if s.isdigit()
                                                           else 1 << 30))
    # per stage band: as many rows as its busiest column
    rows_in: dict[str, int] = {}
    slot: dict[str, int] = {}
    for s in stages:
        per_col: dict[int, int] = collections.Counter()
        for k in nodes:
            if stage_of[k] == s:
                slot[k] = per_col[depth[k]]
                per_col[depth[k]] += 1
        rows_in[s] = max(per_col.values(), default=1)
    band_top: dict[str, float] = {}
    y = _PAD + 18.0
    for s in stages:
        band_top[s] = y
        y += rows_in[s] * _DY + 28
    width = _PAD * 2 + (max(depth.values(), default=0) + 1) * _DX
    height = y + _PAD

    def pos(k: str) -> tuple[float, float]:
        return _PAD + depth[k] * _DX, band_top[stage_of[k]] + 16 + slot[k] * _DY

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
           f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
           'font-family="sans-serif" font-size="10">',
           '<defs><marker id="arrow" viewBox="0 0 8 8" refX="8" refY="4" markerWidth="6" '
           'markerHeight="6" orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#777"/></marker>'
           '</defs>']
    if summary:
        out.append(f'<text x="{_PAD}" y="{_PAD}" font-size="12">{len(keys)} tasks, summarised '
                   f'per stage, phase and layer (max_tasks={max_tasks})</text>')
    for s in stages:
        top = band_top[s]
        out.append(f'<rect class="stage" x="{_PAD / 2}" y="{top}" width="{width - _PAD}" '
                   f'height="{rows_in[s] * _DY + 20}" rx="6" fill="none" stroke="#bbb"/>')
        out.append(f'<text x="{_PAD / 2 + 6}" y="{top + 12}" fill="#555">'
                   f'{escape(stage_label(s))}</text>')
    for k, ds in edges.items():
        x1, y1 = pos(k)
        for d in ds:
            x0, y0 = pos(d)
            out.append(f'<path d="M{x0 + _W},{y0 + _H / 2} C{x0 + _W + 30},{y0 + _H / 2} '
                       f'{x1 - 30},{y1 + _H / 2} {x1},{y1 + _H / 2}" fill="none" '
                       'stroke="#999" stroke-width="0.8" marker-end="url(#arrow)"/>')
    for k, label in nodes.items():
        x0, y0 = pos(k)
        color = colors.get(phase_of[k], colors.get("other", "#E0E0E0"))
        out.append(f'<g class="task"><title>{escape(tips[k])}</title>'
                   f'<rect x="{x0}" y="{y0}" width="{_W}" height="{_H}" rx="3" '
                   f'fill="{color}" stroke="#333" stroke-width="0.5"/>'
                   f'<text x="{x0 + 5}" y="{y0 + 15}">{escape(label[:26])}</text></g>')
    out.append("</svg>")
    return "\n".join(out), len(nodes)


def _group(i: Any) -> str:
    return f"{i.stage}|{i.phase}|{i.layer or ''}"


def _label_of_group(g: str, n: int) -> str:
    stage, phase, layer = g.split("|")
    return f"{phase} {layer}".strip() + f" x{n}"
