"""dd.local_cluster: glibc's top pad reaches every worker process, also after a restart
(XLA's CPU kernels ran 2x slower without it), and the cluster keeps its size."""
from __future__ import annotations

import os

import jax
import numpy as np
import pytest

import dagdiff as dd
from dagdiff.cluster.local import WORKER_MALLOC_ENV
from tests.models import close, data, make_loss


def _env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("MALLOC_TOP_PAD_", "MALLOC_MMAP_THRESHOLD_",
                                           "MALLOC_TRIM_THRESHOLD_", "XLA_FLAGS",
                                           "OMP_NUM_THREADS")}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_workers_start_with_the_top_pad_and_keep_it_after_a_restart() -> None:
    from distributed import Client

    cluster = dd.local_cluster(n_workers=1, dashboard_address=None, quiet=True)
    client = Client(cluster, set_as_default=False)
    try:
        (env,) = client.run(_env).values()
        assert env["MALLOC_TOP_PAD_"] == WORKER_MALLOC_ENV["MALLOC_TOP_PAD_"] == str(64 << 20)
        assert env["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
        assert env["OMP_NUM_THREADS"] == "1"
        assert not (env["XLA_FLAGS"] or "").count("intra_op_parallelism_threads")
        (addr,) = client.scheduler_info()["workers"]
        client.restart_workers([addr])
        client.wait_for_workers(1, timeout=60)
        (env,) = client.run(_env).values()
        assert env["MALLOC_TOP_PAD_"] == WORKER_MALLOC_ENV["MALLOC_TOP_PAD_"]
        assert env["MALLOC_MMAP_THRESHOLD_"] == WORKER_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
        assert list(dd.cluster.info.slot_names(client).values()) == ["slot0"]
    finally:
        client.close()
        cluster.close()


def _exit_process() -> None:
    import threading

    threading.Timer(0.05, os._exit, (1,)).start()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kills", [
    4, pytest.param(30, marks=pytest.mark.skipif(
        not os.environ.get("DAGDIFF_LONG_TESTS"),
        reason="the 30-kill run (~2 min): set DAGDIFF_LONG_TESTS=1"))])
def test_the_cluster_keeps_its_size_through_kills(kills: int) -> None:
    """Every kill of a worker process is followed by a new one from its nanny, also when
    the restart takes longer than distributed's lost-worker timeout (set to 1 s here;
    distributed's own SpecCluster would close that nanny and shrink)."""
    import time

    import dask
    from distributed import Client

    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True)
    client = Client(cluster, set_as_default=False)
    try:
        with dask.config.set({"distributed.deploy.lost-worker-timeout": "1s"}):
            for i in range(kills):
                victim = sorted(client.scheduler_info()["workers"])[i % 2]
                client.run(_exit_process, workers=[victim])
                deadline = time.time() + 120
                while time.time() < deadline:
                    workers = client.scheduler_info()["workers"]
                    if victim not in workers and len(workers) == 2:
                        break
                    time.sleep(0.1)
                else:
                    raise AssertionError(f"kill {i}: workers {sorted(workers)}")
            time.sleep(2.0)                        # past the (1 s) lost-worker timeout
        assert len(cluster.workers) == 2
        assert sorted(dd.cluster.info.slot_names(client).values()) == ["slot0", "slot1"]
        loss_fn = make_loss(2)
        params, x, t = data(2)
        with client.as_current():
            loss, grads = dd.value_and_grad(loss_fn, microbatches=4, schedule="1f1b")(
                params, x, t)
            got_l, got_g = client.compute([loss, grads], sync=True)
        want_l, want_g = jax.value_and_grad(loss_fn)(params, x, t)
        np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
        close(got_g, want_g)
    finally:
        client.close()
        cluster.close()


def _long_call_is_ready_at_once() -> bool:
    """Whether a ~0.1-1 s JAX computation is done when its call returns (it is when JAX
    runs CPU computations inline; with asynchronous dispatch the call returns first)."""
    import jax.numpy as jnp

    def body(i: int, x: jax.Array) -> jax.Array:
        return jnp.tanh(x @ x) * 0.5

    f = jax.jit(lambda x: jax.lax.fori_loop(0, 60, body, x))
    x = jnp.ones((384, 384), jnp.float32) * 0.01
    f(x).block_until_ready()                        # compiled
    y = f(x)
    ready = y.is_ready()
    y.block_until_ready()
    return bool(ready)


@pytest.mark.distributed
def test_workers_run_cpu_computations_inline_and_the_client_keeps_its_dispatch(
        client2: object) -> None:
    """dd.local_cluster's workers run JAX's CPU computations in the calling thread (a
    direct-dispatch program waits for each action anyway); the test process, which
    imported dagdiff and started the cluster, keeps JAX's asynchronous dispatch."""
    ready = client2.run(_long_call_is_ready_at_once)      # type: ignore[attr-defined]
    assert list(ready.values()) == [True, True]
    assert jax.config.read("jax_cpu_enable_async_dispatch") is True
    assert _long_call_is_ready_at_once() is False


def test_an_in_process_worker_leaves_the_users_jax_settings() -> None:
    """A worker without a nanny shares its process (and JAX) with the user: dagdiff's
    worker setup leaves JAX's settings there as they are."""
    from dagdiff.runtime.worker_jax import configure_worker_jax

    class InProcess:
        nanny = None

    assert configure_worker_jax(InProcess()) is False
    assert jax.config.read("jax_cpu_enable_async_dispatch") is True
