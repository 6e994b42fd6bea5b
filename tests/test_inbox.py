"""A client's inbox: `step.compute`'s programs push their outputs to the client as they end
(`dagdiff.runtime.direct.inbox`), and what the client gets is what `jax.value_and_grad`
gives, whether the outputs came by push or through Dask (too large, pushes off, a failed
step, several clients)."""
from __future__ import annotations

import time
from typing import Any

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from distributed import Client, wait

import dagdiff as dd
from dagdiff.runtime.direct.inbox import inbox_for
from tests.models import close, data, make_loss

pytestmark = pytest.mark.distributed


def _ready_inbox(client: Any, step: Any, args: tuple[Any, ...]) -> Any:
    """Compute the step until the client's inbox has a connection to every worker."""
    box = inbox_for(client)
    assert box is not None
    deadline = time.monotonic() + 30
    while box.stats()["open"] < 2:
        assert time.monotonic() < deadline, box.stats()
        step.compute(*args, client=client)
        time.sleep(0.05)
    return box


def _matches(loss_fn: Any, args: tuple[Any, ...], got: Any) -> None:
    want_l, want_g = jax.value_and_grad(loss_fn)(*args)
    np.testing.assert_allclose(got[0], want_l, rtol=1e-5)
    close(got[1], want_g)


def test_step_compute_takes_the_outputs_its_programs_push(client2: Client) -> None:
    """After the first steps open the inbox, each step's outputs come by push: one
    `pushed` step per call, none gathered, each call's values jax's for its batch."""
    loss_fn, (params, x, t) = make_loss(2), data(2)
    step = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")
    box = _ready_inbox(client2, step, (params, x, t))
    before = dict(box.stats())
    for i in range(4):
        xi = x * (1.0 + i)
        _matches(loss_fn, (params, xi, t), step.compute(params, xi, t, client=client2))
    after = box.stats()
    assert after["pushed"] - before["pushed"] == 4, (before, after)
    assert after["gathered"] == before["gathered"], (before, after)


def test_pushes_off_gathers_through_dask(client2: Client) -> None:
    """Dask config ``dagdiff.direct.push-outputs: false``: no inbox, the outputs come
    through Dask, the values are the same."""
    loss_fn, (params, x, t) = make_loss(2), data(2)
    step = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")
    box = _ready_inbox(client2, step, (params, x, t))
    before = dict(box.stats())
    with dask.config.set({"dagdiff.direct.push-outputs": False}):
        assert inbox_for(client2) is None
        _matches(loss_fn, (params, x, t), step.compute(params, x, t, client=client2))
    assert box.stats()["pushed"] == before["pushed"]


def test_outputs_too_large_to_push_come_through_dask(client2: Client) -> None:
    """A worker whose outputs exceed what a program writes itself says so, and the
    client gathers them from Dask at once (no wait for the futures' grace)."""
    loss_fn = make_loss(2)
    params, x, t = data(2, batch=16, width=300)      # 300 x 300 float32 grads: 360 KB
    step = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")
    small = data(2)
    box = _ready_inbox(client2, dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b"),
                       small)
    before = dict(box.stats())
    _matches(loss_fn, (params, x, t), step.compute(params, x, t, client=client2))
    after = box.stats()
    assert after["gathered"] == before["gathered"] + 1, (before, after)


def test_a_failed_step_raises_its_error_with_pushes_on(client2: Client) -> None:
    """A layer failing on stage 1's worker: no push comes for the step, the client
    raises the layer's error from Dask (no hang), and the next step pushes again."""
    from tests.test_direct import fragile_loss as loss_fn

    params = [jnp.eye(8), jnp.eye(8)]
    x, t = jnp.full((8, 8), 0.5), jnp.ones((8, 8))
    step = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")
    box = _ready_inbox(client2, step, (params, x, t))
    with pytest.raises(Exception, match="fragile: input too large"):
        step.compute(params, jnp.full((8, 8), 1000.0), t, client=client2)
    before = dict(box.stats())
    loss, grads = step.compute(params, x, t, client=client2)
    want, want_g = jax.value_and_grad(
        lambda p: jnp.mean((x @ p[0] @ p[1] - t) ** 2))(params)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    close(grads, want_g)
    assert box.stats()["pushed"] == before["pushed"] + 1


def test_two_clients_each_take_their_own_outputs(client2: Client) -> None:
    """Two clients of one cluster, each with its inbox, computing steps of different
    batches in turn: each gets its own step's values."""
    loss_fn, (params, x, t) = make_loss(2), data(2)
    other = Client(client2.scheduler.address, security=client2.security,
                   set_as_default=False)
    try:
        step = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")
        boxes = [_ready_inbox(c, step, (params, x, t)) for c in (client2, other)]
        assert boxes[0].id != boxes[1].id
        for i in range(3):
            for j, c in enumerate((client2, other)):
                xi = x * (1.0 + i) + j
                _matches(loss_fn, (params, xi, t), step.compute(params, xi, t, client=c))
    finally:
        other.close()
    assert boxes[1].stats()["pushed"] >= 3


@pytest.mark.slow
def test_pushes_travel_on_a_tls_cluster() -> None:
    """On a cluster with TLS (`security=True`), the inbox connects with the client's
    security, and the pushed outputs are jax's."""
    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True,
                               security=True)
    client = Client(cluster, set_as_default=False)
    try:
        assert client.scheduler.address.startswith("tls://")
        loss_fn, (params, x, t) = make_loss(2), data(2)
        step = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")
        box = _ready_inbox(client, step, (params, x, t))
        before = dict(box.stats())
        _matches(loss_fn, (params, x, t), step.compute(params, x, t, client=client))
        assert box.stats()["pushed"] == before["pushed"] + 1
    finally:
        client.close()
        cluster.close()


def test_a_closed_clients_inbox_is_dropped_by_the_workers(client2: Client) -> None:
    """A client that opened its inbox and is closed (still referenced): the inbox
    closes within a few seconds and the workers drop their ends of it (no connection
    left waiting per closed client). Told apart by its id: other tests' inboxes may
    close meanwhile."""
    def is_open(inbox: str, dask_worker: Any) -> bool:
        return dask_worker.extensions["dagdiff"].inboxes.is_open(inbox)

    loss_fn, (params, x, t) = make_loss(2), data(2)
    other = Client(client2.scheduler.address, security=client2.security,
                   set_as_default=False)
    step = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")
    box = _ready_inbox(other, step, (params, x, t))
    # a worker opens its end before it answers: every worker has it once the client does
    assert all(client2.run(is_open, box.id).values())
    other.close()
    deadline = time.monotonic() + 20
    while any(client2.run(is_open, box.id).values()):
        assert time.monotonic() < deadline, client2.run(is_open, box.id)
        time.sleep(0.1)


def _trainer_job(client: Client, n: int) -> tuple[Any, ...]:
    """A two-stage model's loss, sgd, its parameters, a `dd.Trainer` of them on `client`,
    the client's inbox (open to both workers) and `n` batches."""
    import optax

    loss_fn, (params, x, t) = make_loss(2), data(2)
    opt = optax.sgd(0.05)
    trainer = dd.Trainer(loss_fn, opt, microbatches=2, schedule="1f1b", client=client)
    box = _ready_inbox(client, dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b"),
                       (params, x, t))
    return loss_fn, opt, params, trainer, box, [(x * (1.0 + i / 4), t) for i in range(n)]


def test_a_trainer_step_loop_takes_its_losses_by_push(client2: Client) -> None:
    """`state, loss = trainer.step(...); loss.result()` in a loop: once the inbox is
    open, each loss comes by push (asked twice: the same value, no new wait); the
    losses and the final parameters equal plain JAX + optax; a loss never asked for
    leaves nothing kept for it in the inbox once the states holding it are gone."""
    import gc

    from tests.models import optax_reference

    loss_fn, opt, params, trainer, box, batches = _trainer_job(client2, 5)
    state = trainer.init(params)
    before = dict(box.stats())
    losses = []
    for batch in batches:
        state, loss = trainer.step(state, *batch)
        losses.append(float(loss.result()))
        assert float(loss.result()) == losses[-1]
    assert box.stats()["pushed"] - before["pushed"] == len(batches), (before, box.stats())
    p, want = optax_reference(loss_fn, opt, params, batches)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    close(trainer.params(state), p)
    state, loss = trainer.step(state, *batches[0])        # never asked for
    key = str(loss.key)
    assert key in box._wanted
    del loss
    for batch in batches:             # the states that hold it (the trainer's) move on
        state, last = trainer.step(state, *batch)
        last.result()
        gc.collect()
        if key not in box._wanted:
            break
    assert key not in box._wanted and key not in box._values


def _spy_pushes(dask_worker: Any, stop: bool = False) -> list[tuple[str, bool]]:
    """On a worker: note (key, noted) of every `push_all` of its inbox ends from now on
    (the pushes noted so far, and the spy removed, with `stop`)."""
    ends = dask_worker.extensions["dagdiff"].inboxes
    if stop:
        ends.__dict__.pop("push_all", None)
        return list(ends.__dict__.pop("_test_pushes", []))
    seen = ends._test_pushes = []
    push_all = type(ends).push_all.__get__(ends)

    def spy(key: str, value: Any, note: bool = False) -> int:
        seen.append((key, note))
        return push_all(key, value, note)

    ends.push_all = spy
    return []


def test_a_trainer_steps_loss_is_pushed_by_its_program(client2: Client) -> None:
    """The loss of `trainer.step` is pushed by the program on its worker as soon as the
    run succeeded (once per step), and its output task, which runs later, does not push
    it again; every loss comes by push and equals optax's."""
    from tests.models import optax_reference

    loss_fn, opt, params, trainer, box, batches = _trainer_job(client2, 4)
    state = trainer.init(params)
    before = dict(box.stats())
    client2.run(_spy_pushes)
    held, losses = [], []
    try:
        for batch in batches:
            state, loss = trainer.step(state, *batch)
            held.append(loss)
            losses.append(float(loss.result()))
        with client2.as_current():
            wait(held)                         # every loss task ran (and would have pushed)
    finally:
        pushes = [p for ps in client2.run(_spy_pushes, stop=True).values() for p in ps]
    assert box.stats()["pushed"] - before["pushed"] == len(batches)
    assert sorted(pushes) == sorted((str(f.key), True) for f in held), pushes
    np.testing.assert_allclose(losses, optax_reference(loss_fn, opt, params, batches)[1],
                               rtol=1e-5)


def test_a_push_on_the_event_loop_never_blocks_on_a_client_that_does_not_read() -> None:
    """`push_all` (a loss task, on the worker's event loop) to a client that stopped
    reading: once the socket cannot take a push at once, the inbox is dropped instead of
    the event loop waiting on it."""
    import asyncio
    import socket
    import threading

    from dagdiff.runtime.direct.inbox import InboxEnds

    mine, theirs = socket.socketpair()
    mine.settimeout(60.0)
    loop = asyncio.new_event_loop()
    try:
        ends = InboxEnds(worker=None, write_timeout=60.0)
        ends._ends["box"] = (mine, threading.Lock(), None, {}, loop, loop.create_future())
        value = np.zeros(1_000, np.float32)             # 4 KB a push
        start, pushes = time.monotonic(), 0
        while ends.push_all("loss-k", value) and pushes < 10_000:
            pushes += 1
        assert time.monotonic() - start < 10, pushes
        assert pushes >= 1 and ends.open_inboxes() == 0
    finally:
        theirs.close()
        mine.close()
        loop.close()
