"""dagdiff against its peers on real compute: the same pipelined job on each, one after the
other in one invocation, with the median step time of each and the ratios.

The job: an MLP of --layers tanh layers --width wide (default 8 x 1024), batch --batch (512),
MSE loss, 2 stages of layers/2 layers each, --microbatches (8) microbatches, gradients kept
on the workers and only the loss returned; median of --steps (6) steps after --warmup (2).

Systems (--systems, default all that are installed):
  dagdiff        `dd.value_and_grad(loss_fn, microbatches=m, schedule=--schedule)` on
                 `dd.local_cluster(2)` (direct dispatch); the step is trace + build + compute
                 of the loss and every gradient leaf; the grads stay on the workers as futures
  dagdiff-values `step.compute(params, x, t)`: the same step with the loss and the grads
                 gathered to the client as values, as `jax.value_and_grad` gives them (each
                 worker's outputs come back in one task)
  dagdiff-gather `client.compute([loss, grads], sync=True)`: the same values gathered by
                 hand (a task per gradient leaf, and one building the grads' pytree; what
                 `step.compute` did before 2026-12-06)
  dagdiff-zbh1   the `dagdiff` row with schedule="zb-h1" (the backward split into input and
                 weight gradients), on the same cluster, whatever --schedule says
  dagdiff-adam   `dd.Trainer(loss_fn, optax.adam(1e-3), ...)`: `trainer.step` + loss.result()
  dagdiff-unfused  the `dagdiff` row with dask config dagdiff.fuse-loss-backward off (the
                 last stage's forward and backward as two jitted calls, as before 2026-12-01)
  dagdiff-fit8   `trainer.fit(batches, window=8)`: the same fit, 8 steps per Dask
                 computation (one program task per worker for 8 steps)
  dagdiff-fitauto  `trainer.fit(batches)` with its default window="auto" (timed on the
                 first steps: a window spans ~0.5 s of steps, at most 64)
  dagdiff-fit    the same Trainer's own loop, `trainer.fit(batches, window=1)` (steps
                 submitted ahead):
                 per step = the fit's time / its steps (median of 3 fits after a warm-up fit)
  torch          torch.distributed.pipelining `Schedule1F1B`, 2 gloo processes
                 (torch.multiprocessing), 1 thread each; the loss stays on the last rank
  torch-gpipe    the same with `ScheduleGPipe`
  torch-adam     `Schedule1F1B` + `torch.optim.Adam(lr=1e-3)` on each rank
  jax            one process: `jax.jit(jax.value_and_grad(loss_fn))` on the whole batch
  jax-adam       one process: jit of value_and_grad + optax adam
  bound          the compute bound of a 1F1B step: the last stage's forward + backward of one
                 microbatch alone on one core (a process pinned to it), in JAX (jit) and in
                 torch (1 thread), times (m + p - 1): no pipeline can do better on p cores that
                 each run one stage; printed, not a row of the ratios (with --split: dagdiff's
                 per-worker busy time, from the actions' own times, against it)
Ratios printed: dagdiff / torch (1F1B and GPipe), dagdiff / jax, ZB-H1 / the dagdiff row and
ZB-H1 / torch 1F1B, and the same for the adam rows.
Worker environment of the dagdiff cluster: --malloc, the glibc malloc variables the workers
start with: `default` = what dd.local_cluster gives them (distributed's
MALLOC_TRIM_THRESHOLD_=65536 plus dagdiff's MALLOC_TOP_PAD_=67108864 and
MALLOC_MMAP_THRESHOLD_=33554432), `toppad` = the top pad alone (dd.local_cluster before
the mmap threshold: ~10% slower steps, less memory), `distributed` =
distributed's trim threshold alone (dd.local_cluster before the fix: 2x slower steps),
`unset` = neither; --xla: `default` = dd.local_cluster's (no XLA_FLAGS), `eigen-off` = the
flags dagdiff used to set (--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1);
--pin: pin worker i and all its threads to core i before the first step.
Also prints each dagdiff worker's RSS after its steps. torch is optional
(`pip install torch`); without it the torch rows are skipped with a message.
Times on a shared machine are noisy: compare the ratios of one run; --rounds N runs the
systems N times in turn and prints the median of the rounds' ratios with each round's.
Usage: python benchmarks/bench_peers.py [--width 1024] [--batch 512] [--microbatches 8]
       [--layers 8] [--schedule 1f1b|gpipe|zb-h1] [--steps 6] [--warmup 2]
       [--systems dagdiff torch jax ...]
       [--malloc default|distributed|unset] [--xla default|eigen-off] [--pin] [--rounds 1]
       [--split]
--split: after the dagdiff row, one more step under `dd.record`: where its time went (client
build and submit, the recorded tasks' span, before the first and after the last F/B action,
each worker's busy time).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import socket
import statistics
import time
from typing import Any, NamedTuple

import numpy as np

SYSTEMS = ("jax", "jax-adam", "torch", "torch-gpipe", "torch-adam", "dagdiff", "dagdiff-values",
           "dagdiff-gather", "dagdiff-zbh1",
           "dagdiff-unfused", "dagdiff-adam", "dagdiff-fit", "dagdiff-fit8", "dagdiff-fitauto",
           "bound")
TOP_PAD = "67108864"
TRIM = "MALLOC_TRIM_THRESHOLD_"
MALLOC_CHOICES = ("default", "toppad", "distributed", "unset")
EIGEN_OFF = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
_ENV0 = dict(os.environ)               # this process's environment before any nanny's additions
_PRE_SPAWN: dict[str, Any] | None = None   # distributed's own pre-spawn-environ, read once
_DD_MALLOC: dict[str, str] | None = None   # dd.local_cluster's own WORKER_MALLOC_ENV


class Cfg(NamedTuple):
    width: int
    batch: int
    microbatches: int
    layers: int
    steps: int
    warmup: int
    seed: int


class Result(NamedTuple):
    times: list[float]      # seconds per measured step
    loss: float             # the first step's loss (the same data and init everywhere)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def make_data(cfg: Cfg) -> tuple[list[tuple[np.ndarray, np.ndarray]],
                                 list[tuple[np.ndarray, np.ndarray]]]:
    """(params, batches) as float32 NumPy arrays, the same for every system: params are
    (w, b) with w (in, out) scaled by 1/sqrt(width); one fresh batch (x, t) per step."""
    rng = np.random.default_rng(cfg.seed)
    w = cfg.width
    params = [((rng.standard_normal((w, w), dtype=np.float32) / np.float32(w**0.5)),
               np.zeros(w, np.float32)) for _ in range(cfg.layers)]
    batches = [(rng.standard_normal((cfg.batch, w), dtype=np.float32),
                rng.standard_normal((cfg.batch, w), dtype=np.float32))
               for _ in range(cfg.warmup + cfg.steps)]
    return params, batches


# ---------------------------------------------------------------------------------- JAX

def _jax_loss(params: Any, x: Any, t: Any) -> Any:
    import jax.numpy as jnp

    h = x
    for p in params:
        h = jnp.tanh(h @ p["w"] + p["b"])
    return jnp.mean((h - t) ** 2)


def run_jax(cfg: Cfg, adam: bool) -> Result:
    """One process, whole batch: jit(value_and_grad) (and optax adam when `adam`)."""
    import jax
    import jax.numpy as jnp
    import optax

    params_np, batches_np = make_data(cfg)
    params = [{"w": jnp.asarray(w), "b": jnp.asarray(b)} for w, b in params_np]
    batches = [(jnp.asarray(x), jnp.asarray(t)) for x, t in batches_np]
    opt = optax.adam(1e-3)
    vg = jax.jit(jax.value_and_grad(_jax_loss))

    @jax.jit
    def train(p: Any, s: Any, x: Any, t: Any) -> Any:
        loss, g = jax.value_and_grad(_jax_loss)(p, x, t)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    from timing import time_steps

    state = opt.init(params)

    def one(i: int, batch: Any) -> Any:
        nonlocal params, state
        if adam:
            params, state, loss = train(params, state, *batch)
            return jax.block_until_ready((params, loss))[1]
        return jax.block_until_ready(vg(params, *batch))[0]

    return Result(*time_steps(one, batches, cfg.warmup))


# -------------------------------------------------------------------------------- torch

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torch_rank(rank: int, world: int, port: int, cfg: Cfg, schedule: str, adam: bool,
                out: Any) -> None:
    """One pipeline stage (rank) of torch.distributed.pipelining on gloo, 1 thread."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        params_np, batches_np = make_data(cfg)
        per = cfg.layers // world
        mods: list[Any] = []
        for w, b in params_np[rank * per:(rank + 1) * per]:
            lin = torch.nn.Linear(cfg.width, cfg.width)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(w.T.copy()))   # torch computes x @ W.T
                lin.bias.copy_(torch.from_numpy(b))
            mods += [lin, torch.nn.Tanh()]
        model = torch.nn.Sequential(*mods)
        stage = PipelineStage(model, rank, world, torch.device("cpu"))
        cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        sched = cls(stage, n_microbatches=cfg.microbatches,
                    loss_fn=torch.nn.functional.mse_loss)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3) if adam else None
        last = rank == world - 1
        times, first = [], float("nan")
        for i, (x, t) in enumerate(batches_np):
            xs, ts = torch.from_numpy(x), torch.from_numpy(t)
            losses: list[Any] = []
            dist.barrier()
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if rank == 0:
                sched.step(xs)
            elif last:
                sched.step(target=ts, losses=losses, return_outputs=False)
            else:
                sched.step()
            if opt is not None:
                opt.step()
            if last:
                loss = torch.stack(losses).mean().item()    # what a driver would read
            dist.barrier()                                   # every rank is done
            dt = time.perf_counter() - t0
            if last and i == 0:
                first = loss
            if i >= cfg.warmup:
                times.append(dt)
        out.put((rank, times, first))
    finally:
        dist.destroy_process_group()


def run_torch(cfg: Cfg, schedule: str, adam: bool, env: dict[str, str]) -> Result:
    """2 spawned processes (torch.multiprocessing), one pipeline stage each; `env` is the
    environment they start with (the caller's original one)."""
    import torch.multiprocessing as mp

    world = 2
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({**env, "OMP_NUM_THREADS": "1"})
    try:
        mp.start_processes(_torch_rank, args=(world, _free_port(), cfg, schedule, adam, q),
                           nprocs=world, join=True, start_method="spawn")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    got = dict((r, (ts, loss)) for r, ts, loss in (q.get() for _ in range(world)))
    # every rank timed barrier-to-barrier: rank 0's step times, the last rank's loss
    return Result(got[0][0], got[world - 1][1])


# ------------------------------------------------------------------------------ dagdiff

def _dd_loss(params: Any, x: Any, t: Any) -> Any:
    from common import two_stage_loss    # imported here: torch's ranks need no dagdiff

    return two_stage_loss(params, x, t)


def _pin_all_threads(i: int) -> list[int]:
    """Pin every thread of this process (and threads it starts later) to core i mod n."""
    cores = sorted(os.sched_getaffinity(0))
    core = {cores[i % len(cores)]}
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), core)
        except OSError:
            pass
    return sorted(core)


def _worker_probe() -> dict[str, Any]:
    with open("/proc/self/status") as f:
        st = dict(line.split(":", 1) for line in f if ":" in line)
    return {"rss_mb": int(st["VmRSS"].split()[0]) / 1024, "hwm_mb": int(st["VmHWM"].split()[0])
            / 1024, "threads": int(st["Threads"]), "trim": os.environ.get(TRIM),
            "top_pad": os.environ.get("MALLOC_TOP_PAD_"), "xla": os.environ.get("XLA_FLAGS"),
            "mmap": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "affinity": sorted(os.sched_getaffinity(0))}


def start_cluster(malloc: str, xla: str, pin: bool) -> tuple[Any, Any]:
    """dd.local_cluster(2) with the chosen worker environment; returns (cluster, client)."""
    import dask
    from distributed import Client

    import dagdiff as dd

    global _PRE_SPAWN, _DD_MALLOC
    # a nanny writes its pre-spawn environment into this process too, and its children
    # would inherit it
    for k in (TRIM, "MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_"):
        if k not in _ENV0:
            os.environ.pop(k, None)
    if _PRE_SPAWN is None:
        _PRE_SPAWN = dict(dask.config.get("distributed.nanny.pre-spawn-environ"))
    pre = dict(_PRE_SPAWN)          # as found (and restored after another choice)
    import dagdiff.cluster.local as ddc

    # dd.local_cluster's nannies add ddc.WORKER_MALLOC_ENV to the pre-spawn environment
    if _DD_MALLOC is None:
        _DD_MALLOC = dict(ddc.WORKER_MALLOC_ENV)
    ddc.WORKER_MALLOC_ENV = {"default": _DD_MALLOC, "toppad": {"MALLOC_TOP_PAD_": TOP_PAD}}.get(
        malloc, {})
    if malloc == "unset":
        pre[TRIM] = None            # None unsets a key (distributed.nanny._get_env_variables)
    dask.config.set({"distributed.nanny.pre-spawn-environ": pre})
    env = {"XLA_FLAGS": EIGEN_OFF} if xla == "eigen-off" else {}
    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True, env=env)
    client = Client(cluster)
    if pin:
        from dagdiff.cluster.info import slot_names

        for addr, slot in slot_names(client).items():   # slot<i> -> core i
            client.run(_pin_all_threads, int(slot[4:]), workers=[addr])
    return cluster, client


def run_dagdiff(client: Any, cfg: Cfg, schedule: str) -> Result:
    """dd.value_and_grad pipeline: per step trace + build + compute of the loss and every
    gradient leaf in one graph; only the loss is gathered, the grads stay as futures."""
    import jax
    import jax.numpy as jnp
    from distributed import wait

    import dagdiff as dd

    params_np, batches_np = make_data(cfg)
    params = [{"w": jnp.asarray(w), "b": jnp.asarray(b)} for w, b in params_np]
    batches = [(jnp.asarray(x), jnp.asarray(t)) for x, t in batches_np]
    from timing import time_steps

    step = dd.value_and_grad(_dd_loss, microbatches=cfg.microbatches, schedule=schedule)
    futs: list[Any] = []

    def release() -> None:           # the previous step's futures, before the clock starts
        nonlocal futs
        futs = []

    def one(i: int, batch: Any) -> Any:
        nonlocal futs
        loss, grads = step(params, *batch)
        futs = client.compute([loss, *jax.tree_util.tree_leaves(grads)])
        value = futs[0].result()
        wait(futs)                   # the grads are computed (on the workers), not gathered
        return value

    with client.as_current():
        out = Result(*time_steps(one, batches, cfg.warmup, before=release))
    futs = []
    return out


def run_dagdiff_values(client: Any, cfg: Cfg, schedule: str, by_hand: bool = False) -> Result:
    """dd.value_and_grad pipeline through `step.compute`: per step trace + build + compute,
    the loss and every gradient leaf back on the client as values (`by_hand`: through
    ``client.compute([loss, grads], sync=True)`` instead)."""
    import jax.numpy as jnp

    import dagdiff as dd

    params_np, batches_np = make_data(cfg)
    params = [{"w": jnp.asarray(w), "b": jnp.asarray(b)} for w, b in params_np]
    batches = [(jnp.asarray(x), jnp.asarray(t)) for x, t in batches_np]
    from timing import time_steps

    step = dd.value_and_grad(_dd_loss, microbatches=cfg.microbatches, schedule=schedule)

    def one(i: int, batch: Any) -> Any:
        if by_hand:
            loss, _ = client.compute(list(step(params, *batch)), sync=True)
        else:
            loss, _ = step.compute(params, *batch, client=client)
        return loss

    return Result(*time_steps(one, batches, cfg.warmup))


def run_dagdiff_adam(client: Any, cfg: Cfg, schedule: str) -> Result:
    """dd.Trainer with optax.adam: trainer.step + loss.result() per step."""
    import jax.numpy as jnp
    import optax

    import dagdiff as dd

    params_np, batches_np = make_data(cfg)
    params = [{"w": jnp.asarray(w), "b": jnp.asarray(b)} for w, b in params_np]
    batches = [(jnp.asarray(x), jnp.asarray(t)) for x, t in batches_np]
    tr = dd.Trainer(_dd_loss, optax.adam(1e-3), microbatches=cfg.microbatches,
                    schedule=schedule, client=client)
    from timing import time_steps

    state = tr.init(params, *batches[0])

    def one(i: int, batch: Any) -> Any:
        nonlocal state
        state, loss = tr.step(state, *batch)
        return loss.result()

    out = Result(*time_steps(one, batches, cfg.warmup))
    del state
    return out


def run_dagdiff_fit(client: Any, cfg: Cfg, schedule: str, window: int | str = 1) -> Result:
    """dd.Trainer.fit with optax.adam over the steps (it submits steps ahead, so one step's
    start overlaps the previous one's end): the time per step of the whole fit, after a
    warm-up fit; each entry of `times` is one fit's total / its steps."""
    import jax.numpy as jnp
    import optax

    import dagdiff as dd

    params_np, batches_np = make_data(cfg)
    params = [{"w": jnp.asarray(w), "b": jnp.asarray(b)} for w, b in params_np]
    batches = [(jnp.asarray(x), jnp.asarray(t)) for x, t in batches_np]
    tr = dd.Trainer(_dd_loss, optax.adam(1e-3), microbatches=cfg.microbatches,
                    schedule=schedule, client=client)
    from timing import mean_seconds

    state, losses = tr.fit(batches[:cfg.warmup], params=params, progress=False,
                           window=window)
    times = mean_seconds(lambda: tr.fit(batches[cfg.warmup:], state=state, progress=False,
                                        window=window),
                         cfg.steps, repeat=3)
    return Result(times, float(losses[0]))


# -------------------------------------------------------------------------- compute bound

def _stage_fb(kind: str, cfg: Cfg, out: Any) -> None:
    """In a process pinned to one core: median time of the last stage's forward + backward
    (parameters and input cotangent; loss included) of one microbatch."""
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    params_np, batches_np = make_data(cfg)
    per = cfg.layers // 2
    rows = cfg.batch // cfg.microbatches
    x, t = batches_np[0][0][:rows], batches_np[0][1][:rows]
    ws = params_np[per:]
    times = []
    if kind == "jax":
        import jax
        import jax.numpy as jnp

        ps = [{"w": jnp.asarray(w), "b": jnp.asarray(b)} for w, b in ws]
        fb = jax.jit(jax.value_and_grad(_jax_loss, argnums=(0, 1)))
        xj, tj = jnp.asarray(x), jnp.asarray(t)
        for _ in range(30):
            t0 = time.perf_counter()
            jax.block_until_ready(fb(ps, xj, tj))
            times.append(time.perf_counter() - t0)
    else:
        import torch

        torch.set_num_threads(1)
        mods: list[Any] = []
        for w, b in ws:
            lin = torch.nn.Linear(cfg.width, cfg.width)
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(w.T.copy()))
                lin.bias.copy_(torch.from_numpy(b))
            mods += [lin, torch.nn.Tanh()]
        model = torch.nn.Sequential(*mods)
        xt, tt = torch.from_numpy(x), torch.from_numpy(t)
        for _ in range(30):
            t0 = time.perf_counter()
            xx = xt.clone().requires_grad_(True)
            torch.nn.functional.mse_loss(model(xx), tt).backward()
            times.append(time.perf_counter() - t0)
    out.put(statistics.median(times[5:]))


def run_bound(cfg: Cfg, kinds: list[str]) -> dict[str, float]:
    """`_stage_fb` of each kind in its own spawned process (one after the other)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    got = {}
    for kind in kinds:
        q = ctx.SimpleQueue()
        proc = ctx.Process(target=_stage_fb, args=(kind, cfg, q))
        proc.start()
        got[kind] = q.get()
        proc.join()
    return got


def dagdiff_split(client: Any, cfg: Cfg, schedule: str) -> dict[str, Any]:
    """One more value_and_grad step under `dd.record`: the split of its time."""
    import jax
    import jax.numpy as jnp
    from distributed import wait

    import dagdiff as dd

    params_np, batches_np = make_data(cfg)
    params = [{"w": jnp.asarray(w), "b": jnp.asarray(b)} for w, b in params_np]
    x, t = map(jnp.asarray, batches_np[-1])
    step = dd.value_and_grad(_dd_loss, microbatches=cfg.microbatches, schedule=schedule)
    with client.as_current():                   # a first call traces and compiles
        loss, grads = step(params, *map(jnp.asarray, batches_np[-2]))
        wait(client.compute([loss, *jax.tree_util.tree_leaves(grads)]))
        del loss, grads
    with client.as_current(), dd.record(client) as rec:
        t0 = time.perf_counter()
        loss, grads = step(params, x, t)
        t1 = time.perf_counter()
        futs = client.compute([loss, *jax.tree_util.tree_leaves(grads)])
        t2 = time.perf_counter()
        futs[0].result()
        wait(futs)
        t3 = time.perf_counter()
        del futs
    acts = [a for a in rec.tasks if a.phase in ("F", "B", "I", "W")]
    first, last = min(a.start for a in rec.tasks), max(a.stop for a in rec.tasks)
    busy: dict[str, float] = {}
    for a in acts:
        busy[a.worker] = busy.get(a.worker, 0.0) + a.stop - a.start
    return {"step": t3 - t0, "build": t1 - t0, "submit": t2 - t1,
            "outside": (t3 - t0) - (last - first) - (t2 - t0),
            "head": min(a.start for a in acts) - first,
            "span": max(a.stop for a in acts) - min(a.start for a in acts),
            "tail": last - max(a.stop for a in acts), "busy": sorted(busy.values())}


# --------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    from timing import job_args

    # --rounds: the systems this many times in turn (one dagdiff cluster); the ratios are
    # the median of each round's ratio (a noisy machine drifts); --steps: their median
    job_args(ap, width=1024, batch=512, microbatches=8, layers=8, steps=6, warmup=2,
             rounds=1, seed=0)
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "zb-h1"),
                    help="dagdiff's schedule (torch runs 1F1B and GPipe)")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--malloc", default="default", choices=MALLOC_CHOICES,
                    help="glibc malloc variables of the dagdiff workers (see above)")
    ap.add_argument("--xla", default="default", choices=("default", "eigen-off"),
                    help="XLA_FLAGS of the dagdiff workers: dd.local_cluster's, or the old flags")
    ap.add_argument("--pin", action="store_true", help="pin dagdiff worker i to core i")
    ap.add_argument("--split", action="store_true",
                    help="after the dagdiff row, where one more step's time went")
    a = ap.parse_args()
    if a.layers % 2 or a.batch % a.microbatches:
        ap.error("--layers must be even and --batch a multiple of --microbatches")
    cfg = Cfg(a.width, a.batch, a.microbatches, a.layers, a.steps, a.warmup, a.seed)
    systems = [s for s in SYSTEMS if s in a.systems]
    bound_kinds = ["jax"] + (["torch"] if importlib.util.find_spec("torch") else [])
    if any(s.startswith("torch") for s in systems):
        try:
            importlib.import_module("torch.distributed.pipelining")
        except ImportError as e:
            print(f"torch rows skipped: torch (with torch.distributed.pipelining) is not "
                  f"installed ({e}); pip install torch")
            systems = [s for s in systems if not s.startswith("torch")]
    print(f"MLP {a.layers} x {a.width} tanh, batch {a.batch}, 2 stages x {a.layers // 2} "
          f"layers, {a.microbatches} microbatches; median of {a.steps} steps after "
          f"{a.warmup} warm-ups; {os.cpu_count()} cores")
    rounds: list[dict[str, Result]] = []
    res: dict[str, Result] = {}

    def show(name: str, what: str) -> None:
        r = res[name]
        tag = f"[{len(rounds)}] " if a.rounds > 1 else ""
        print(f"  {tag}{what:<52} {r.median * 1e3:8.1f} ms  (min {min(r.times) * 1e3:.1f}, "
              f"max {max(r.times) * 1e3:.1f}; loss {r.loss:.6f})", flush=True)

    dds = [s for s in systems if s.startswith("dagdiff")]
    cluster = client = None
    if dds:
        cluster, client = start_cluster(a.malloc, a.xla, a.pin)
    try:
        for _ in range(a.rounds):
            res = {}
            rounds.append(res)
            for s in systems:
                if s.startswith("jax"):
                    res[s] = run_jax(cfg, adam=s == "jax-adam")
                    show(s, "jax.jit(value_and_grad), 1 process" + (" + optax adam"
                                                                    if s == "jax-adam" else ""))
                elif s.startswith("torch"):
                    sch = "gpipe" if s == "torch-gpipe" else "1f1b"
                    res[s] = run_torch(cfg, sch, adam=s == "torch-adam", env=_ENV0)
                    show(s, f"torch pipelining {'GPipe' if sch == 'gpipe' else '1F1B'}, 2 gloo "
                         "ranks" + (" + Adam" if s == "torch-adam" else ""))
                elif s == "bound":
                    m, p = cfg.microbatches, 2
                    for kind, sec in run_bound(cfg, bound_kinds).items():
                        print(f"  {'[%d] ' % len(rounds) if a.rounds > 1 else ''}last stage F+B "
                              f"of one microbatch on one core, {kind:<5} {sec * 1e3:8.1f} ms: "
                              f"1F1B compute bound (m + p - 1) x that = "
                              f"{sec * (m + p - 1) * 1e3:.1f} ms", flush=True)
                elif s == "dagdiff":
                    res[s] = run_dagdiff(client, cfg, a.schedule)
                    show(s, f"dagdiff value_and_grad {a.schedule}, 2 workers")
                    if a.split:
                        sp = dagdiff_split(client, cfg, a.schedule)
                        print("    split of one more step (ms): step {:.1f} = build {:.1f} + "
                              "submit {:.1f} + recorded tasks {:.1f} (to the first action "
                              "{:.1f}, actions' span {:.1f}, after the last {:.1f}) + outside "
                              "them {:.1f}; busy per worker {}".format(
                                  *(1e3 * sp[k] for k in ("step", "build", "submit")),
                                  1e3 * (sp["head"] + sp["span"] + sp["tail"]),
                                  *(1e3 * sp[k] for k in ("head", "span", "tail", "outside")),
                                  ", ".join(f"{1e3 * b:.1f}" for b in sp["busy"])),
                              flush=True)
                elif s == "dagdiff-values":
                    res[s] = run_dagdiff_values(client, cfg, a.schedule)
                    show(s, f"dagdiff step.compute {a.schedule} (values), 2 workers")
                elif s == "dagdiff-gather":
                    res[s] = run_dagdiff_values(client, cfg, a.schedule, by_hand=True)
                    show(s, f"dagdiff client.compute(sync=True) {a.schedule}, 2 workers")
                elif s == "dagdiff-zbh1":
                    res[s] = run_dagdiff(client, cfg, "zb-h1")
                    show(s, "dagdiff value_and_grad zb-h1, 2 workers")
                elif s == "dagdiff-unfused":
                    import dask
                    with dask.config.set({"dagdiff.fuse-loss-backward": False}):
                        res[s] = run_dagdiff(client, cfg, a.schedule)
                    show(s, "  the same, loss stage's F and B unfused")
                elif s == "dagdiff-adam":
                    res[s] = run_dagdiff_adam(client, cfg, a.schedule)
                    show(s, f"dagdiff Trainer {a.schedule} + optax adam, 2 workers")
                elif s == "dagdiff-fit8":
                    res[s] = run_dagdiff_fit(client, cfg, a.schedule, window=8)
                    show(s, f"dagdiff Trainer.fit window=8 {a.schedule} + adam (per step)")
                elif s == "dagdiff-fitauto":
                    res[s] = run_dagdiff_fit(client, cfg, a.schedule, window="auto")
                    show(s, f"dagdiff Trainer.fit window=auto {a.schedule} + adam (per step)")
                else:
                    res[s] = run_dagdiff_fit(client, cfg, a.schedule)
                    show(s, f"dagdiff Trainer.fit {a.schedule} + adam (per step, 3 fits)")
        if client is not None:
            probe = client.run(_worker_probe)
            print(f"  dagdiff workers (--malloc {a.malloc}, --xla {a.xla}"
                  f"{', pinned' if a.pin else ''}):")
            for addr, p in sorted(probe.items()):
                print(f"    {addr}: RSS {p['rss_mb']:.0f} MB (peak {p['hwm_mb']:.0f}), "
                      f"{p['threads']} threads, cores {p['affinity']}, {TRIM}={p['trim']}, "
                      f"MALLOC_TOP_PAD_={p['top_pad']}, MALLOC_MMAP_THRESHOLD_={p['mmap']}, "
                      f"XLA_FLAGS={p['xla']!r}")
    finally:
        if client is not None:
            client.close()
            cluster.close()
    print("ratios (median step time" + (f"; median over {a.rounds} rounds, each round's "
                                        "ratio in brackets)" if a.rounds > 1 else "):"))
    for dd_row, peer, label in (("dagdiff", "torch", "dagdiff / torch 1F1B"),
                                ("dagdiff", "torch-gpipe", "dagdiff / torch GPipe"),
                                ("dagdiff", "jax", "dagdiff / jax.jit"),
                                ("dagdiff-values", "torch", "dagdiff step.compute / torch 1F1B"),
                                ("dagdiff-values", "dagdiff", "step.compute / value_and_grad"),
                                ("dagdiff-values", "dagdiff-gather",
                                 "step.compute / client.compute sync"),
                                ("dagdiff-zbh1", "dagdiff",
                                 f"dagdiff zb-h1 / dagdiff {a.schedule}"),
                                ("dagdiff-zbh1", "torch", "dagdiff zb-h1 / torch 1F1B"),
                                ("dagdiff", "dagdiff-unfused", "dagdiff / dagdiff unfused"),
                                ("dagdiff-adam", "torch-adam", "dagdiff Trainer / torch + Adam"),
                                ("dagdiff-adam", "jax-adam", "dagdiff Trainer / jax.jit + adam"),
                                ("dagdiff-fit", "torch-adam", "dagdiff fit / torch + Adam"),
                                ("dagdiff-fit8", "torch-adam",
                                 "dagdiff fit window=8 / torch + Adam"),
                                ("dagdiff-fit8", "dagdiff-fit", "fit window=8 / window=1"),
                                ("dagdiff-fitauto", "torch-adam",
                                 "dagdiff fit window=auto / torch + Adam"),
                                ("dagdiff-fitauto", "dagdiff-fit", "fit window=auto / window=1")):
        ratios = [r[dd_row].median / r[peer].median for r in rounds if dd_row in r and peer in r]
        if ratios:
            each = (" [" + ", ".join(f"{x:.2f}" for x in ratios) + "]") if len(ratios) > 1 else ""
            print(f"  {label:<34} {statistics.median(ratios):6.2f}{each}")


if __name__ == "__main__":
    main()
