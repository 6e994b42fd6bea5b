"""`dd.local_cluster`: the embedded default cluster, one worker per GPU (or per CPU slot)."""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import dask
from distributed import LocalCluster, Nanny

from ..errors import ArgumentError
from ..runtime.internals import cluster_status_hook, correct_state
from ..runtime.plugins import ColocateVJP


__all__ = ["CPU_WORKER_ENV", "WORKER_MALLOC_ENV", "GPU_WORKER_ENV", "gpu_count", "local_cluster"]


#: single-threaded BLAS/OpenMP in CPU workers. No XLA_FLAGS: the usual
#: ``--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1`` does not make XLA
#: single-threaded (a stage's forward 5.3 ms with and without it, 8.2 ms pinned to one core)
#: and two workers without it were as fast or up to 10% faster (benchmarks/bench_peers.py)
CPU_WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


#: glibc malloc settings a nanny gives its worker process before it starts (the moment
#: glibc reads them). distributed starts workers with MALLOC_TRIM_THRESHOLD_=65536
#: (``distributed.nanny.pre-spawn-environ``); any explicit trim threshold switches off
#: glibc's dynamic mmap threshold, so every buffer of 128 KiB or more that XLA allocates
#: (activations, gradients, optimizer state) is a fresh mmap with its page faults:
#: dagdiff's 1F1B step on 2 workers took 1.2 s instead of 0.55 s. A 64 MiB top pad beside
#: it gave most of the speed back (worker RSS ~0.5 GB instead of ~0.33 GB on that job);
#: an mmap threshold of 32 MiB (glibc's own dynamic maximum) gives the rest: such buffers
#: come from the heap and are reused. Measured in one process (a 4-layer 64 x 1024 stage's
#: forward + backward / an adam step of its 4 M parameters): no variable 17 / 9-12 ms,
#: distributed's threshold 48-59 / 25-30 ms, + top pad 21-25 / 16-22 ms, + mmap threshold
#: 16-19 / 9 ms; on the bench_peers.py job, two clusters side by side: the 1F1B step 610
#: -> 542 ms, a Trainer + adam step 625 -> 574 ms, worker RSS ~0.57 -> ~0.8 GB. distributed's
#: trimming is kept (memory above the pad goes back to the system).
WORKER_MALLOC_ENV = {"MALLOC_TOP_PAD_": str(64 << 20), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


#: a GPU worker's JAX must not take 75% of the card up front
GPU_WORKER_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}


def gpu_count() -> int:
    """Number of NVIDIA GPUs visible here (0 without nvidia-smi); never raises."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        return sum(line.startswith("GPU ") for line in out.stdout.splitlines())
    except Exception:
        return 0


def _slotted(base: type) -> type:
    class SlottedCluster(base):  # type: ignore[misc, valid-type]
        """A local cluster whose i-th worker has the start-up resource ``slot<i>``, and
        which keeps its size: a lost worker's nanny starts a new worker process."""

        dagdiff_worker_config: dict[str, Any] = {}

        def _update_worker_status(self, op: str, msg: Any) -> None:
            """SpecCluster closes the nanny of a worker that has not come back within
            ``distributed.deploy.lost-worker-timeout`` (15 s) and does not replace it,
            so a cluster whose workers restart slowly (JAX imports on a loaded machine)
            shrank for good after a few losses. Here the nanny stays: it restarts its
            worker, however long that takes and however often it happens."""
            cluster_status_hook(self, base, op, msg,
                                keep_nanny=getattr(self, "_dagdiff_keep_size", True))

        def new_worker_spec(self) -> dict[Any, Any]:
            spec = {}

            for name, d in super().new_worker_spec().items():  # d is shared: copy it
                opts = dict(d["options"])
                opts["resources"] = {**(opts.get("resources") or {}), f"slot{name}": 1}
                cls = d.get("cls")
                nanny = isinstance(cls, type) and issubclass(cls, Nanny)
                if self.dagdiff_worker_config and nanny:  # its config replaces the worker's

                    opts["config"] = dask.config.merge(dask.config.config,
                                                       self.dagdiff_worker_config)
                spec[name] = {**d, "options": opts}
                if nanny:
                    spec[name]["cls"] = _malloc_nanny(cls)
            return spec

    SlottedCluster.__name__ = f"Slotted{base.__name__}"
    return SlottedCluster


_NANNIES: dict[type, type] = {}


def _malloc_nanny(base: type) -> type:
    """`base` (a Nanny class) starting its worker with `WORKER_MALLOC_ENV` added to the
    pre-spawn environment (kept for every restart of that worker)."""
    if base.__name__.startswith("Dagdiff"):
        return base
    cls = _NANNIES.get(base)
    if cls is None:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            base.__init__(self, *args, **kwargs)
            self.pre_spawn_env.update(WORKER_MALLOC_ENV)

        cls = _NANNIES[base] = type(f"Dagdiff{base.__name__}", (base,),
                                    {"__init__": __init__, "__doc__": _malloc_nanny.__doc__})
    return cls


def local_cluster(
    n_workers: int | None = None,
    *,
    host: str = "127.0.0.1",
    dashboard_address: str | None = "127.0.0.1:8787",
    env: dict[str, str] | None = None,
    gpu: bool | None = None,
    quiet: bool = False,
    profile: bool = False,
    **kwargs: Any,
) -> Any:
    """Start the embedded default cluster and return it (a `distributed.LocalCluster`).

    On a machine with GPUs (and dask-cuda installed), one worker per GPU whose JAX sees
    only its own GPU and does not preallocate the card; otherwise `n_workers`
    (default: the number of cores) single-threaded worker processes. Worker processes
    start with `WORKER_MALLOC_ENV` (glibc's top pad and mmap threshold; see there:
    without them XLA's CPU kernels ran 2-3x slower under distributed's malloc trim
    threshold). Worker i has the
    resource ``slot<i>`` (see module docstring). Extra keyword arguments go to the cluster
    class. Prints the dashboard link unless `quiet`.

    `profile=False` turns off distributed's sampling profiler on the workers (the
    dashboard's Profile tab stays empty): it walks every thread's stack every 10 ms, and
    a pipeline step parks one thread per task, which doubled the workers' CPU time per
    step in our measurements.
    """
    ngpu = gpu_count() if gpu is None else (gpu_count() if gpu else 0)
    base: type = LocalCluster
    worker_env = dict(env or {})
    if ngpu:
        try:
            from dask_cuda import LocalCUDACluster

            base = LocalCUDACluster
        except ImportError:
            base = LocalCluster
            worker_env = {**worker_env}
        worker_env = {**GPU_WORKER_ENV, **worker_env}
        n = n_workers or ngpu
    else:
        worker_env = {**CPU_WORKER_ENV, **worker_env}
        n = n_workers or os.cpu_count() or 1
    if n < 1:
        raise ArgumentError(f"local_cluster needs n_workers >= 1, got {n_workers}")
    sched = dict(kwargs.pop("scheduler_kwargs", None) or {})
    sched.setdefault("plugins", [ColocateVJP()])
    if dashboard_address is None:  # no dashboard at all (tests, benchmarks)
        sched.setdefault("dashboard", False)
    cls = _slotted(base)
    if not profile:
        cls.dagdiff_worker_config = {"distributed": {"worker": {"profile": {"enabled": False}}}}
    options: dict[str, Any] = dict(
        n_workers=0, threads_per_worker=1, processes=True, host=host,
        dashboard_address=dashboard_address or "127.0.0.1:0", scheduler_kwargs=sched,
        env=worker_env,
        preload=["dagdiff"],   # registers jax-array serializers before any data arrives
    )
    if base is not LocalCluster:  # dask-cuda sets CUDA_VISIBLE_DEVICES per worker itself
        options.pop("threads_per_worker")
    options.update(kwargs)
    if options.get("processes") is False:   # in-process workers: inproc://, one environment
        options.pop("host", None)
        options.pop("env", None)
    cluster = cls(**options)
    cluster.scale(n)
    correct_state(cluster)
    if not quiet and dashboard_address is not None:
        print(f"dagdiff: {n} worker(s); dashboard at {cluster.dashboard_link}")
    return cluster
