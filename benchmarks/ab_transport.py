"""A/B of direct dispatch's transport: another checkout of dagdiff (e.g. the one with its own
TCP channel) against this one, side by side in one run, on sleep-based stages.

For each tree, in turns (A, B, A, B, ...), a fresh 4-worker `dd.local_cluster` measures,
with direct dispatch: schedule makespan / ideal (first to last F/B/I/W action, from
`dd.record`) for GPipe, 1F1B, interleaved and ZB-H1 at m = 8 with F = I = W = 20 ms and
5 ms (B = 2F), 1F1B's whole step (submit to result) over its ideal makespan, and the
per-hop latency (a GPipe chain with m = 1 and 1 ms stages, whose first and last actions
run on one worker: (span - compute) / hops between workers). Sleep stages measure
scheduling and transport only, not compute. Prints best-of-repeat per turn and the B/A
ratios of the medians over turns.

Usage: python benchmarks/ab_transport.py --a /path/to/old/checkout [--b .] [--turns 2]
(make the old checkout with ``git worktree add /tmp/old <commit>``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def measure(f_list: list[float], repeat: int) -> dict[str, Any]:
    """Run in a subprocess whose `dagdiff` is the tree under test."""
    from distributed import Client

    import dagdiff as dd
    from bench_pipeline import run
    from dagdiff.schedules import ideal_makespan

    p = 4
    cluster = dd.local_cluster(n_workers=p, dashboard_address=None, quiet=True)
    client = Client(cluster)
    out: dict[str, Any] = {"dagdiff": dd.__file__}
    for f in f_list:
        for name in SCHEDULES:
            r = run(client, name, p, 8, f, repeat, "direct")
            ideal = ideal_makespan(name, p, 8, f=f, b=2 * f)
            out[f"{name}@{f * 1e3:g}ms"] = r.span / ideal
            if name == "1f1b":
                out[f"1f1b-wall@{f * 1e3:g}ms"] = r.wall / ideal
    # per hop: a GPipe chain with m = 1 (F0..F3 B3..B0, first and last action on worker 0,
    # so the span is read on one clock): (span - compute) / hops between workers
    hops = []
    for _ in range(3):
        r = run(client, "gpipe", p, 1, 0.001, repeat, "direct")
        busy = sorted((t for t in r.rec.tasks if t.phase in ("F", "B")), key=lambda t: t.start)
        n = sum(a.worker != b.worker for a, b in zip(busy, busy[1:]))
        hops.append((r.span - sum(t.stop - t.start for t in busy)) / max(n, 1))
    out["hop_ms"] = 1e3 * min(hops)
    client.close()
    cluster.close()
    return out


def run_tree(tree: str, f_list: list[float], repeat: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import ab_transport as m; print('RESULT', json.dumps(m.measure({f_list!r}, "
            f"{repeat})))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, cwd=os.path.abspath(tree), timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{tree}: no result\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--a", required=True, help="checkout A (e.g. the old TCP channel)")
    ap.add_argument("--b", default=".", help="checkout B (default: this one)")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--f-ms", type=float, nargs="*", default=[20.0, 5.0],
                    help="stage lengths to run the schedules at (none: only the hop)")
    a = ap.parse_args()
    f_list = [f / 1e3 for f in a.f_ms]
    results: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    for turn in range(a.turns):
        for label, tree in (("A", a.a), ("B", a.b)):
            t0 = time.perf_counter()
            r = run_tree(tree, f_list, a.repeat)
            results[label].append(r)
            cols = "  ".join(f"{k} {v:.2f}" for k, v in r.items() if k != "dagdiff")
            print(f"turn {turn} {label} ({r['dagdiff']}, {time.perf_counter() - t0:.0f} s): "
                  f"{cols}", flush=True)
    keys = [k for k in results["A"][0] if k != "dagdiff"]
    print(f"\n{'measure':<22} {'A median':>9} {'B median':>9} {'B/A':>6}")
    for k in keys:
        ma = statistics.median(r[k] for r in results["A"])
        mb = statistics.median(r[k] for r in results["B"])
        print(f"{k:<22} {ma:>9.3f} {mb:>9.3f} {mb / ma:>6.2f}")
    print("(schedule rows: makespan / ideal; 1f1b-wall: submit to result / ideal; "
          "hop_ms: time per hop between workers, ms)")


if __name__ == "__main__":
    main()
