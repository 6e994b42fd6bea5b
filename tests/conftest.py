"""Shared fixtures: the three ways to run a graph (sync, threads, a 2-worker LocalCluster)."""
from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import dask
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# a direct-dispatch step that hangs fails with its facts (which action waits for what)
# well before pytest-timeout's 300 s; kernels started by the notebook tests inherit it
os.environ.setdefault("DASK_DAGDIFF__DIRECT__TIMEOUT", "120s")
dask.config.refresh()

WORKER_ENV = {
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1 "
                 "--xla_force_host_platform_device_count=4",
    "OMP_NUM_THREADS": "1",
    "JAX_PLATFORMS": "cpu",
}


def _cluster_client(n: int) -> Iterator[Any]:
    """A LocalCluster of n worker processes and a non-default client, torn down after."""
    from distributed import Client

    import dagdiff as dd
    from dagdiff.runtime.plugins import ensure_colocation

    cluster = dd.local_cluster(n_workers=n, env=WORKER_ENV, dashboard_address=None, quiet=True)
    client = Client(cluster, set_as_default=False)
    ensure_colocation(client)
    yield client
    client.close()
    cluster.close()


@pytest.fixture(scope="session")
def client2() -> Iterator[Any]:
    """A client of a 2-worker cluster, shared by the whole session."""
    yield from _cluster_client(2)


@pytest.fixture(scope="session")
def client4() -> Iterator[Any]:
    """A client of a 4-worker cluster (workers mostly wait on each other; fits 2 cores)."""
    yield from _cluster_client(4)


@pytest.fixture(params=["sync", "threads", "distributed"])
def compute(request: Any) -> Callable[..., Any]:
    """compute(*collections) on each scheduler; the distributed one uses the 2-worker cluster."""
    if request.param == "distributed":
        client = request.getfixturevalue("client2")

        def run(*colls: Any) -> Any:
            with client.as_current():
                return client.compute(list(colls), sync=True)
        return run

    def run_local(*colls: Any) -> Any:
        return list(dask.compute(*colls, scheduler=request.param))
    return run_local
