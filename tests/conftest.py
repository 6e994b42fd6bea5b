"""Shared fixtures: the three ways to run a graph (sync, threads, a 2-worker LocalCluster)."""
from __future__ import annotations

import os
from typing import Any, Callable

import dask
import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

WORKER_ENV = {
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1 "
                 "--xla_force_host_platform_device_count=4",
    "OMP_NUM_THREADS": "1",
    "JAX_PLATFORMS": "cpu",
}


@pytest.fixture(scope="session")
def cluster2() -> Any:
    """A 2-worker LocalCluster of processes, shared by the whole session."""
    import dagdiff as dd

    cluster = dd.local_cluster(n_workers=2, env=WORKER_ENV, dashboard_address=None, quiet=True)
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def client2(cluster2: Any) -> Any:
    from distributed import Client

    from dagdiff.colocate import ensure_colocation

    client = Client(cluster2, set_as_default=False)
    ensure_colocation(client)
    yield client
    client.close()


@pytest.fixture(params=["sync", "threads", "distributed"])
def compute(request: Any) -> Callable[..., Any]:
    """compute(*collections) on each scheduler; the distributed one uses the 2-worker cluster."""
    if request.param == "distributed":
        client = request.getfixturevalue("client2")

        def run(*colls: Any) -> Any:
            with client.as_current():
                return client.compute(list(colls), sync=True)
        run.client = client  # type: ignore[attr-defined]
        run.name = "distributed"  # type: ignore[attr-defined]
        return run

    def run_local(*colls: Any) -> Any:
        return list(dask.compute(*colls, scheduler=request.param))
    run_local.client = None  # type: ignore[attr-defined]
    run_local.name = request.param  # type: ignore[attr-defined]
    return run_local


@pytest.fixture(scope="session")
def cluster4() -> Any:
    """A 4-worker LocalCluster (workers mostly wait on each other; fits 2 cores)."""
    import dagdiff as dd

    cluster = dd.local_cluster(n_workers=4, env=WORKER_ENV, dashboard_address=None, quiet=True)
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def client4(cluster4: Any) -> Any:
    from distributed import Client

    client = Client(cluster4, set_as_default=False)
    yield client
    client.close()
