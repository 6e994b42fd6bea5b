"""Several clients on one cluster: a notebook restarted against a running cluster, two
notebooks, a script beside a notebook. Opening, using and closing one client leaves every
other client's pipelined steps (direct dispatch) working, with and without TLS."""
from __future__ import annotations

from typing import Any, Iterator

import jax
import numpy as np
import optax
import pytest
from distributed import Client

import dagdiff as dd
from tests.models import optax_reference
from tests.models import close, data, make_loss

pytestmark = pytest.mark.distributed


def _runtime_open(dask_worker: Any) -> bool:
    """The worker's direct-dispatch runtime is installed and still sends."""
    rt = dask_worker.extensions.get("dagdiff")
    return rt is not None and not rt.transport._closed


def _other_client(client: Any) -> Client:
    """A second client of `client`'s cluster, with its security (TLS) if any."""
    return Client(client.scheduler.address, security=client.security, set_as_default=False)


def _matches_jax(fn: Any, args: tuple[Any, ...], got: tuple[Any, Any]) -> None:
    want_l, want_g = jax.value_and_grad(fn)(*args)
    np.testing.assert_allclose(got[0], want_l, rtol=1e-5)
    close(got[1], want_g)


def _a_trainer_step_from(other: Client, loss_fn: Any, args: tuple[Any, ...]) -> float:
    trainer = dd.Trainer(loss_fn, optax.sgd(0.1), microbatches=2, schedule="1f1b",
                         client=other)
    state = trainer.init(args[0])
    state, loss = trainer.step(state, *args[1:])
    return float(loss.result())


@pytest.fixture(scope="module")
def tls_client() -> Iterator[Client]:
    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True, security=True)
    client = Client(cluster, set_as_default=False)
    yield client
    client.close()
    cluster.close()


@pytest.fixture(params=["tcp", pytest.param("tls", marks=pytest.mark.slow)])
def client(request: Any) -> Client:
    return request.getfixturevalue("client2" if request.param == "tcp" else "tls_client")


def test_closing_another_client_leaves_pipelined_steps_working(client: Client) -> None:
    """The issue's patterns, each against jax.value_and_grad: B opens, runs a Trainer step
    and closes; then A's step, the same step again, a new Trainer on A, and three steps in
    flight while a third client opens, runs a step and closes."""
    loss_fn = make_loss(2)
    args = data(2)
    step = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")
    with client.as_current():
        _matches_jax(loss_fn, args, client.compute(step(*args), sync=True))

    other = _other_client(client)
    try:
        first = _a_trainer_step_from(other, loss_fn, args)
    finally:
        other.close()
    np.testing.assert_allclose(first, jax.value_and_grad(loss_fn)(*args)[0], rtol=1e-5)
    assert all(client.run(_runtime_open).values())

    with client.as_current():
        built = step(*args)
        _matches_jax(loss_fn, args, client.compute(built, sync=True))
        _matches_jax(loss_fn, args, client.compute(built, sync=True))   # the same step again

        params, x, t = args
        batches = [(x * (1 + i / 4), t) for i in range(3)]
        trainer = dd.Trainer(loss_fn, optax.sgd(0.1), microbatches=2, schedule="1f1b",
                             client=client)
        state, losses = trainer.fit(batches, progress=False, params=params)
        want_p, want_losses = optax_reference(loss_fn, optax.sgd(0.1), params, batches)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        close(trainer.params(state), want_p)

        in_flight = [client.compute(step(params, xb, tb)) for xb, tb in batches]
        third = _other_client(client)
        try:
            with third.as_current():
                _matches_jax(loss_fn, args, third.compute(step(*args), sync=True))
        finally:
            third.close()
        for (xb, tb), fut in zip(batches, in_flight):
            _matches_jax(loss_fn, (params, xb, tb), client.gather(fut))
        _matches_jax(loss_fn, args, client.compute(step(*args), sync=True))


def test_a_second_client_keeps_the_workers_plugin(client2: Client) -> None:
    """dagdiff's worker plugin is registered once per cluster: a second client's
    registration neither replaces it nor tears it down (distributed's `idempotent`)."""
    from dagdiff.runtime.plugins import ensure_colocation

    def plugin_id(dask_worker: Any) -> int:
        return id(dask_worker.plugins["dagdiff-load"])

    before = client2.run(plugin_id)
    other = _other_client(client2)
    try:
        assert ensure_colocation(other)
        assert other.run(plugin_id) == before
    finally:
        other.close()
    assert client2.run(plugin_id) == before
    assert all(client2.run(_runtime_open).values())


def _stream_intervals(dask_scheduler: Any, client_id: str) -> tuple[float, list[float]]:
    """The scheduler's flush interval towards one client, and towards each worker."""
    return (dask_scheduler.client_comms[client_id].interval,
            [b.interval for b in dask_scheduler.stream_comms.values()])


def test_every_message_stream_of_a_step_flushes_within_a_millisecond(client2: Client) -> None:
    """distributed flushes a client's messages to the scheduler every 10 ms and the
    scheduler's to a client every 2 ms (to workers 5 ms, workers' 2 ms): each a wait at
    a step's start or end. On a cluster with dagdiff's plugins, a client dagdiff
    submits through, and the scheduler's stream back to it, flush within
    `dagdiff.batched-send-interval` (1 ms); a second client too, once it submits a
    step; and the step's values still match jax."""
    loss_fn, (params, x, t) = make_loss(2), data(2)
    other = _other_client(client2)
    try:
        assert other.scheduler_comm.interval == pytest.approx(0.010)  # distributed's own
        step = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")
        got = step.compute(params, x, t, client=other)
        _matches_jax(loss_fn, (params, x, t), got)
        assert other.scheduler_comm.interval <= 0.001
        to_client, to_workers = other.run_on_scheduler(_stream_intervals, client_id=other.id)
        assert to_client <= 0.001 and to_workers and max(to_workers) <= 0.001
        worker_side = other.run(lambda dask_worker: dask_worker.batched_stream.interval)
        assert max(worker_side.values()) <= 0.001
    finally:
        other.close()


def test_batched_send_interval_default_keeps_distributeds_client_stream(client2: Client
                                                                       ) -> None:
    """``dagdiff.batched-send-interval: default`` leaves a client's stream as distributed
    made it (10 ms)."""
    import dask

    loss_fn, (params, x, t) = make_loss(2), data(2)
    other = _other_client(client2)
    try:
        with dask.config.set({"dagdiff.batched-send-interval": "default"}):
            step = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")
            _matches_jax(loss_fn, (params, x, t), step.compute(params, x, t, client=other))
        assert other.scheduler_comm.interval == pytest.approx(0.010)
    finally:
        other.close()
