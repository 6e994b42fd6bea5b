"""JAX settings a dagdiff worker makes before its first JAX computation: CPU computations
run in the thread that calls them, without JAX's asynchronous dispatch.

A direct-dispatch program waits for every action it runs (`block_until_ready`), so on a
CPU worker asynchronous dispatch only adds a hand-over to JAX's dispatch thread and back
per action. Measured on this project's 2-core machine (one process, a 2-layer 64-wide
forward with its pullback on 8 rows): 81 -> 25 us per call, 191 -> 46 us with both cores
busy; in a windowed `Trainer.fit` of the tiny job each worker's actions took 25-35% less
time. JAX reads the setting when it creates its CPU client, so it has to be made before
the process's first computation: `dask worker --preload dagdiff` and `dd.local_cluster`
make it at the worker's start (`dagdiff.dask_setup`), before any task; a worker that ran
JAX before dagdiff was loaded keeps asynchronous dispatch (correct, a little slower).
Only a worker started by a nanny (a process of its own) is set up so: an in-process
worker (``processes=False``) shares JAX with the notebook that started it, whose settings
stay the user's. GPU computations are not affected. Dask config
``dagdiff.worker.cpu-async-dispatch`` (default False) keeps JAX's default instead.
"""
from __future__ import annotations

from typing import Any

import dask
import jax


__all__ = ["configure_worker_jax", "ASYNC_DISPATCH_KEY"]

#: dask config key: True keeps JAX's asynchronous CPU dispatch on dagdiff's workers
ASYNC_DISPATCH_KEY = "dagdiff.worker.cpu-async-dispatch"


def configure_worker_jax(worker: Any) -> bool:
    """Make the JAX settings of `worker`'s process (see the module docstring); returns
    whether CPU computations were set to run inline. Call it before the process's first
    JAX computation: JAX reads the setting once, when it creates its CPU client."""
    if getattr(worker, "nanny", None) is None:       # in-process: the user's JAX
        return False
    inline = not bool(dask.config.get(ASYNC_DISPATCH_KEY, False))
    if inline:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    return inline
