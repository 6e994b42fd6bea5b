"""`python -m dagdiff demo`: train an MLP classifier on scikit-learn's bundled digits data as
a pipeline on an embedded LocalCluster, then report test accuracy and draw one step."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import dagdiff as dd

from ..errors import ScheduleError
from ..extras import require
from ..schedules import SCHEDULES, get_schedule


__all__ = ["main", "build_parser", "run_demo"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m dagdiff demo",
        description="Train a 3-layer MLP on the digits data set (bundled with scikit-learn) "
                    "as a pipeline of stages on a local Dask cluster, with the backward pass "
                    "derived by dagdiff. Prints the dashboard link, a progress bar, the test "
                    "accuracy, and writes a timeline picture of one training step.")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--stages", type=int, default=2, help="pipeline stages (default 2)")
    ap.add_argument("--schedule", default="1f1b",
                    help=f"{' | '.join(SCHEDULES)} (default 1f1b)")
    ap.add_argument("--microbatches", type=int, default=8, help="per step (default 8)")
    ap.add_argument("--replicas", type=int, default=1, help="data-parallel copies (default 1)")
    ap.add_argument("--steps", type=int, default=150, help="training steps (default 150)")
    ap.add_argument("--batch", type=int, default=128, help="batch size (default 128)")
    ap.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden width (default 128)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--timeline", default="dagdiff-step.png",
                    help="where to write the timeline PNG of one step ('' to skip)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--dashboard", default="127.0.0.1:8787",
                    help="dashboard address (default 127.0.0.1:8787; '' for none)")
    return ap


def _check(args: argparse.Namespace) -> str | None:
    for name in ("workers", "stages", "microbatches", "replicas", "steps", "batch", "hidden"):
        if getattr(args, name) < 1:
            return f"--{name} must be >= 1, got {getattr(args, name)}"
    try:
        sched = get_schedule(args.schedule)
    except ScheduleError as e:
        return f"--schedule: {e}"
    if args.batch % (args.microbatches * args.replicas):
        return (f"--batch {args.batch} must be a multiple of --microbatches x --replicas "
                f"({args.microbatches * args.replicas})")
    if args.stages > 3:
        return "--stages: this 3-layer demo model has at most 3 stages"
    if args.stages % sched.virtual_stages:
        return (f"--schedule {sched.name} needs --stages a multiple of its "
                f"{sched.virtual_stages} virtual stages per worker")
    try:
        sched.validate(args.stages // sched.virtual_stages, args.microbatches)
    except ScheduleError as e:
        return f"--schedule {sched.name} with --microbatches {args.microbatches}: {e}"
    if args.lr <= 0:
        return f"--lr must be positive, got {args.lr}"
    return None


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    import optax
    from distributed import Client
    require("sklearn", "the demo (its digits data set)")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=args.seed,
                                          stratify=y)
    mean, std = xtr.mean(0), xtr.std(0) + 1e-3
    xtr, xte = (xtr - mean) / std, (xte - mean) / std

    @dd.layer(name="hidden")
    def hidden(p: Any, h: Any) -> Any:
        return jax.nn.relu(h @ p["w"] + p["b"])

    @dd.layer(name="logits")
    def logits(p: Any, h: Any) -> Any:
        return h @ p["w"] + p["b"]

    @dd.layer(name="xent")
    def xent(z: Any, labels: Any) -> Any:
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(z), labels[:, None], 1))

    n_layers = 3

    def stage_of(i: int) -> int:
        return i * args.stages // n_layers

    def loss_fn(params: Any, xb: Any, yb: Any) -> Any:
        h = xb
        for i, p in enumerate(params[:-1]):
            with dd.stage(stage_of(i)):
                h = hidden(p, h)
        with dd.stage(stage_of(n_layers - 1)):
            return xent(logits(params[-1], h), yb)

    key = jax.random.PRNGKey(args.seed)
    sizes = [64, args.hidden, args.hidden, 10]
    params = [{"w": jax.random.normal(k, (a, b)) * jnp.sqrt(2.0 / a), "b": jnp.zeros(b)}
              for k, a, b in zip(jax.random.split(key, 3), sizes[:-1], sizes[1:])]
    rng = np.random.default_rng(args.seed)

    def batches() -> Any:
        while True:
            order = rng.permutation(len(xtr))
            for i in range(0, len(order) - args.batch + 1, args.batch):
                idx = order[i:i + args.batch]
                yield jnp.asarray(xtr[idx]), jnp.asarray(ytr[idx])

    cluster = dd.local_cluster(n_workers=args.workers, dashboard_address=args.dashboard or None,
                               quiet=not args.dashboard)
    client = Client(cluster)
    try:
        trainer = dd.Trainer(loss_fn, optax.adam(args.lr), microbatches=args.microbatches,
                             schedule=args.schedule, replicas=args.replicas, client=client)
        t0 = time.perf_counter()
        state, losses = trainer.fit(batches(), steps=args.steps,
                                    progress=not args.no_progress, params=params)
        elapsed = time.perf_counter() - t0
        if args.timeline:
            xb, yb = next(batches())
            with dd.record(client) as rec:
                _, loss = trainer.step(state, xb, yb)
                loss.result()
            rec.timeline(args.timeline, title=f"one step: {args.schedule}, "
                         f"{args.microbatches} microbatches, {args.stages} stages")
        final = trainer.params(state)
        h = jnp.asarray(xte)
        for p in final[:-1]:
            h = hidden(p, h)             # layers run eagerly on concrete arrays
        pred = np.asarray(jnp.argmax(logits(final[-1], h), axis=1))
        acc = float((pred == yte).mean())
    finally:
        client.close()
        cluster.close()
    return {"accuracy": acc, "losses": losses, "seconds": elapsed,
            "timeline": args.timeline or None}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "demo":
        print("usage: python -m dagdiff demo [options]   (python -m dagdiff demo --help)",
              file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv[1:])
    problem = _check(args)
    if problem:
        print(f"dagdiff demo: error: {problem}", file=sys.stderr)
        return 2
    out = run_demo(args)
    losses = out["losses"]
    print(f"trained {args.steps} steps in {out['seconds']:.1f} s "
          f"({args.steps / out['seconds']:.1f} steps/s); loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}; test accuracy {out['accuracy']:.1%}")
    if out["timeline"]:
        print(f"timeline of one step written to {out['timeline']}")
    return 0
