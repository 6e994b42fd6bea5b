"""Direct dispatch: one program per worker in the order of a simulated run, values worker
to worker over distributed's comms, and failures that reach the caller instead of hanging
(`test_direct_plan.py`: the pure part; `test_direct_pieces.py`: piece by piece)."""
from __future__ import annotations

import time
from typing import Any

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dagdiff as dd
from dagdiff.runtime.direct import RunNonce, run_program
from dagdiff.runtime.direct.messages import pack, unpack
from tests.models import assert_matches_jax, close, data, make_loss, probe_every


# --- on a cluster ---------------------------------------------------------------------

@pytest.mark.distributed
@pytest.mark.parametrize("schedule,n_stages,m", [
    ("1f1b", 4, 8), ("gpipe", 4, 4), ("zb-h1", 4, 8), ("interleaved", 8, 4), ("1f1b", 4, 3),
])
def test_direct_dispatch_equals_full_batch_jax(client4: Any, schedule: str, n_stages: int,
                                               m: int) -> None:
    loss_fn = make_loss(n_stages)
    params, x, t = data(n_stages, batch=4 * m)
    with client4.as_current():
        loss, grads = dd.value_and_grad(loss_fn, microbatches=m, schedule=schedule,
                                        dispatch="direct")(params, x, t)
        got_l, got_g = client4.compute([loss, grads], sync=True)
    want_l, want_g = jax.value_and_grad(loss_fn)(params, x, t)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    close(got_g, want_g)
    assert dd.remat_count(client4) == 0


def _serving(dask_worker: Any) -> bool:
    """The worker still answers direct-dispatch streams and probes."""
    return {"dagdiff_stream", "dagdiff_status"} <= set(dask_worker.handlers)


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_steps_stay_right_while_every_wait_probes_its_producer(client4: Any) -> None:
    """Regression (CI hang with the old channel): a program waiting >2 s probes its
    producer; here every wait probes every millisecond, for several steps, and every
    step stays right and the workers keep serving."""
    loss_fn = make_loss(4)
    params, x, t = data(4, batch=32)
    want_l, want_g = jax.value_and_grad(loss_fn)(params, x, t)
    old = client4.run(probe_every, 0.001)
    try:
        with client4.as_current():
            for schedule in ["1f1b", "zb-h1", "gpipe"]:
                for _ in range(2):
                    loss, grads = dd.value_and_grad(loss_fn, microbatches=8,
                                                    schedule=schedule)(params, x, t)
                    got_l, got_g = client4.compute([loss, grads], sync=True)
                    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
                    close(got_g, want_g)
    finally:
        for w, (after, every) in old.items():
            client4.run(probe_every, after, workers=[w])
    assert all(client4.run(_serving).values())


@pytest.mark.distributed
def test_a_step_is_one_program_per_worker_in_schedule_order(client2: Any) -> None:
    from dagdiff.lowering import template

    # a freshly lowered step: a template bound from an earlier test keeps the names its
    # programs gave their inputs, which this test reads
    template.clear()
    loss_fn = make_loss(2)
    params, x, t = data(2)
    with client2.as_current():
        step = dd.value_and_grad(loss_fn, microbatches=4, schedule="1f1b")
        loss, grads = step(params, x, t)
    dsk = dict(loss.__dask_graph__())
    progs = {k: v.args[0] for k, v in dsk.items() if getattr(v, "func", None) is run_program}
    assert len(progs) == 2
    # each output (the loss, every gradient leaf) waits for both programs and reads its
    # own worker's program result in place: no completion or pick task in between
    for out in [loss, *jax.tree_util.tree_leaves(grads)]:
        assert dsk[out.key].dependencies == set(progs), out.key
        assert dsk[out.key].is_coro, out.key        # run on the worker's event loop
    # stage 0's program (it starts the pipeline) is sent first
    (layer,) = loss.__dask_graph__().layers.values()
    prio = {k: layer.annotations["priority"](k) for k in progs}
    lead = next(k for k, p in progs.items()
                if any((i.phase, i.stage) == ("F", 0) for i in map(dd.key_info,
                                                                   (a.key for a in p.actions))))
    assert prio[lead] == max(prio.values()) > min(prio.values()), prio
    assert len({dsk[k].args[1] for k in progs}) == 1         # one run id for the step
    for k, prog in progs.items():
        # programs read only the step's inputs, never each other (values go directly)
        assert not set(dsk[k].dependencies) & set(progs), k
        # the step's inputs that are Dask keys (resident parameters), and no task for the
        # run id: the programs carry one (stamped afresh by the scheduler per submission);
        # the batch travels inside the program task (no scattered data: recomputable)
        resident = {s for s in prog.statics if not s.startswith("input_")}
        assert set(dsk[k].dependencies) == resident
        assert type(dsk[k].args[1]) is RunNonce
        actions = [a.key for a in prog.actions]
        # no action is also an ordinary task, except as its program's export
        for a in prog.actions:
            if a.key in dsk:
                assert a.export and dsk[a.key].dependencies == {k}, a.key
        stage = min(i.stage for i in map(dd.key_info, actions) if i.phase == "F")
        want = dd.get_schedule("1f1b").actions(num_stages=2, microbatches=4)[stage]
        got = []
        for key in actions:
            info = dd.key_info(key)
            if info.phase in ("F", "B") and info.layer != "mse" and info.stage == stage:
                got.append(f"{info.phase}{info.microbatch}")
        assert [g for i, g in enumerate(got) if g not in got[:i]] == want, prog.where


@pytest.mark.distributed
def test_a_parameter_the_loss_does_not_use_gets_zeros_inside_a_program(client2: Any) -> None:
    """Regression: a leaf the loss never reads (a head left out of this loss) had its
    zero gradient summed over the microbatches by a chain of m tasks with no stage, each
    a Dask round trip outside the programs (a zero-time step went from ~9 to ~28 ms).
    Its zeros are now one action of the loss's program; values equal jax's."""
    loss_fn = make_loss(2)
    params, x, t = data(2, batch=16)
    params = [*params, {"w": jnp.ones((8, 3)), "b": jnp.zeros(3)}]     # unused by loss_fn
    with client2.as_current():
        step = dd.value_and_grad(loss_fn, microbatches=4, schedule="1f1b")
        loss, grads = step(params, x, t)
        got_l, got_g = client2.compute([loss, grads], sync=True)
    assert_matches_jax(loss_fn, (params, x, t), got_l, got_g)
    np.testing.assert_array_equal(got_g[2]["w"], np.zeros((8, 3)))
    dsk = dict(loss.__dask_graph__())
    progs = {k for k, v in dsk.items() if getattr(v, "func", None) is run_program}
    assert len(progs) == 2
    # every task is a program or an output waiting for both (no accumulation outside)
    for k, v in dsk.items():
        assert k in progs or v.dependencies == progs, (k, v.dependencies)
    loss_l, grads_l = step.compute(params, x, t, client=client2)
    assert_matches_jax(loss_fn, (params, x, t), loss_l, grads_l)
    # a Trainer leaves such a leaf as its optimizer does (adam: unchanged)
    import optax

    from tests.models import optax_reference
    tr = dd.Trainer(loss_fn, optax.adam(1e-2), microbatches=4, schedule="1f1b",
                    client=client2)
    state, losses = tr.fit([(x, t)] * 3, params=params, progress=False)
    want_p, want_l = optax_reference(loss_fn, optax.adam(1e-2), params, [(x, t)] * 3)
    np.testing.assert_allclose(losses, want_l, rtol=1e-5)
    close(tr.params(state), want_p)


def _tied_loss(params: Any, x: Any, t: Any) -> Any:
    """Weights tied across stages: params[0] on stage 0 and again on stage 1."""
    from tests.models import dense, mse

    with dd.stage(0):
        h = dense(params[0], x)
    with dd.stage(1):
        h = dense(params[0], h)
        h = dense(params[1], h)
        return mse(h, t)


@pytest.mark.distributed
@pytest.mark.parametrize("dispatch", ["direct", "scheduler"])
def test_weights_tied_across_stages_are_summed_on_each_stage_then_once(
        client2: Any, dispatch: str) -> None:
    """Regression: a leaf used on two stages had its gradient summed over the microbatches
    by m chained tasks with no stage, outside the programs, each reading both workers
    (the step's every VJP result then left its program too: ~90 -> 28 ms a step here).
    Each stage now sums its own part in its accumulator and one task adds the two; values
    equal jax's, and a Trainer's steps equal optax's."""
    import optax

    from tests.models import optax_reference

    params, x, t = data(2, batch=16)
    with client2.as_current():
        step = dd.value_and_grad(_tied_loss, microbatches=4, schedule="1f1b",
                                 dispatch=dispatch)
        loss, grads = step(params, x, t)
        got_l, got_g = client2.compute([loss, grads], sync=True)
    assert_matches_jax(_tied_loss, (params, x, t), got_l, got_g)
    dsk = dict(loss.__dask_graph__())
    if dispatch == "direct":
        progs = {k for k, v in dsk.items() if getattr(v, "func", None) is run_program}
        outside = [k for k in dsk if k not in progs]
        # the outputs, and one pick of stage 1's sum for the tied leaf's final add
        assert len(outside) == 1 + len(jax.tree_util.tree_leaves(params)) + 1, outside
        assert sum(dd.key_info(k).phase == "acc" for k in outside) == 1, outside
    else:
        accs = [k for k in dsk if dd.key_info(k).phase == "acc"]
        assert accs and all(dd.key_info(k).stage is not None for k in accs), accs
    tr = dd.Trainer(_tied_loss, optax.adam(1e-2), microbatches=4, schedule="1f1b",
                    client=client2, dispatch=dispatch)
    state, losses = tr.fit([(x, t)] * 3, params=params, progress=False)
    want_p, want_l = optax_reference(_tied_loss, optax.adam(1e-2), params, [(x, t)] * 3)
    np.testing.assert_allclose(losses, want_l, rtol=1e-5)
    close(tr.params(state), want_p)


def _explode_fwd(w: Any, x: Any) -> Any:
    x = np.asarray(x)
    if np.any(x != 0):      # shapes are inferred on zeros: fail on real data only
        raise RuntimeError("boom on purpose")
    return x @ np.asarray(w), None


def _explode_bwd(res: Any, ct: Any) -> Any:
    return None, None


exploding = dd.custom_layer(_explode_fwd, _explode_bwd, name="exploding")


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_failing_task_reaches_the_caller_and_the_cluster_goes_on(client2: Any) -> None:
    def bad_loss(params: Any, x: Any, t: Any) -> Any:
        with dd.stage(0):
            h = _dense0(params[0], x)
        with dd.stage(1):
            h = exploding(params[1], h)
            return _mse(h, t)

    params = [jnp.eye(8), jnp.eye(8)]
    x = jnp.ones((8, 8))
    t0 = time.perf_counter()
    with client2.as_current():
        loss, grads = dd.value_and_grad(bad_loss, microbatches=4, schedule="1f1b")(params, x, x)
        with pytest.raises(Exception, match="boom on purpose"):
            client2.compute([loss, grads], sync=True)
    assert time.perf_counter() - t0 < 60          # not the 600 s wait timeout
    # the workers are free again: a good step runs
    loss_fn = make_loss(2)
    p2, x2, t2 = data(2)
    with client2.as_current():
        loss, grads = dd.value_and_grad(loss_fn, microbatches=4, schedule="1f1b")(p2, x2, t2)
        got = client2.compute(loss, sync=True)
    np.testing.assert_allclose(got, jax.value_and_grad(loss_fn)(p2, x2, t2)[0], rtol=1e-5)
    # no program is left waiting on any worker
    assert _waiting(client2) == 0


@dd.layer
def _dense0(w: Any, x: Any) -> Any:
    return jnp.tanh(x @ w)


@dd.layer
def _mse(y: Any, t: Any) -> Any:
    return jnp.mean((y - t) ** 2)


def _running(dask_worker: Any) -> int:
    return len(dask_worker.extensions["dagdiff"]._running)


def _running_keys(dask_worker: Any) -> list[str]:
    return sorted(dask_worker.extensions["dagdiff"]._running)


def _waiting(client: Any, within: float = 10.0) -> int:
    deadline = time.time() + within
    while True:
        n = sum(client.run(_running).values())
        if n == 0 or time.time() > deadline:
            if n:
                print("still waiting:", client.run(_running_keys))
            return n
        time.sleep(0.2)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_cancelled_step_frees_its_waiting_tasks(client2: Any) -> None:
    from dagdiff.examples.simulated import sleepy_pipeline

    fn = sleepy_pipeline(2, 0.3)          # 0.3 s forwards: the step is still running
    params = [jnp.float32(1.0)] * 2
    with client2.as_current():
        loss, grads = dd.value_and_grad(fn, microbatches=4, schedule="1f1b")(
            params, jnp.ones((4, 4)))
        futures = client2.compute([loss, grads])
        deadline = time.time() + 30
        while sum(client2.run(_running).values()) == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert sum(client2.run(_running).values()) > 0       # tasks are waiting
        client2.cancel(futures)
        del futures
    assert _waiting(client2, within=20) == 0


# --- found while writing these tests ------------------------------------------------------

def _double_fwd(x: Any) -> Any:
    return 2.0 * np.asarray(x), None


def _double_bwd(res: Any, ct: Any) -> Any:
    return (2.0 * np.asarray(ct),)


def test_custom_layers_are_not_fused_with_their_neighbours() -> None:
    """Fusing runs a stage as one jitted function; a hand-written (NumPy) layer inside
    it used to run its shape stand-in instead of its rules (zeros, no gradient)."""
    import dask

    double = dd.custom_layer(_double_fwd, _double_bwd, name="double",
                             jax_fn=None)

    def loss_fn(params: Any, x: Any, t: Any) -> Any:
        with dd.stage(0):
            h = _dense0(params[0], x)
            h = double(h)
            h = _dense0(params[1], h)
        with dd.stage(1):
            return _mse(h, t)

    def reference(params: Any, x: Any, t: Any) -> Any:
        h = jnp.tanh(x @ params[0]) * 2.0
        h = jnp.tanh(h @ params[1])
        return jnp.mean((h - t) ** 2)

    k = jax.random.PRNGKey(3)
    params = [jax.random.normal(k, (8, 8)) * 0.3, jax.random.normal(k + 1, (8, 8)) * 0.3]
    x = jax.random.normal(k + 2, (8, 8))
    t = jax.random.normal(k + 3, (8, 8))
    loss, grads = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")(params, x, t)
    got_l, got_g = dask.compute(loss, grads, scheduler="threads")
    want_l, want_g = jax.value_and_grad(reference)(params, x, t)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    close(got_g, want_g)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_computing_only_the_grads_runs_the_whole_step(client2: Any) -> None:
    """Dask culls what an output does not need; the loss tasks of a direct step hold
    positions in their worker's order, so they must survive computing grads alone."""
    loss_fn = make_loss(2)
    params, x, t = data(2)
    with client2.as_current():
        _, grads = dd.value_and_grad(loss_fn, microbatches=4, schedule="1f1b")(params, x, t)
        got = client2.compute(grads, sync=True)
    close(got, jax.grad(loss_fn)(params, x, t))


def _dependencies(keys: list[str], dask_scheduler: Any = None) -> dict[str, list[str]]:
    return {k: sorted(str(d.key) for d in dask_scheduler.tasks[k].dependencies)
            for k in keys if k in dask_scheduler.tasks}


def _programs_of(delayed: Any) -> list[str]:
    return sorted(k for k in delayed.dask if str(k).startswith("prog"))


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["client.compute", "dask.compute", "persist"])
def test_outputs_computed_together_wait_for_their_own_program_alone(client2: Any,
                                                                    how: str) -> None:
    """A step's loss and gradient leaves computed in one call: each waits for its own
    worker's program only (no fetch of the other program's stub); one computed alone
    waits for every program, so that computing it runs the whole step."""
    loss_fn = make_loss(2)
    params, x, t = data(2)
    with client2.as_current():
        loss, grads = dd.value_and_grad(loss_fn, microbatches=4, schedule="1f1b")(
            params, x, t)
        leaves = jax.tree_util.tree_leaves(grads)
        keys = [d.key for d in (loss, *leaves)]
        progs = _programs_of(loss)
        assert len(progs) == 2
        if how == "client.compute":
            futures = client2.compute([loss, *leaves])
            got = client2.gather(futures)
        elif how == "persist":
            futures = client2.persist([loss, *leaves])
            got = dask.compute(*futures)
        else:
            got = dask.compute(loss, *leaves)
            # another step's loss alone: it waits for both programs
            alone, _ = dd.value_and_grad(loss_fn, microbatches=4, schedule="1f1b")(
                params, 2 * x, t)
            futures = [client2.compute(alone)]
            keys, progs = [alone.key], _programs_of(alone)
            futures[0].result()
        deps = client2.run_on_scheduler(_dependencies, keys)
    want_l, want_g = jax.value_and_grad(loss_fn)(params, x, t)
    np.testing.assert_allclose(got[0], want_l, rtol=1e-5)
    close(got[1:], jax.tree_util.tree_leaves(want_g))
    if how == "dask.compute":
        assert deps == {keys[0]: progs}
        np.testing.assert_allclose(futures[0].result(), loss_fn(params, 2 * x, t), rtol=1e-5)
    else:
        assert all(len(d) == 1 and d[0] in progs for d in deps.values()), deps
        assert {d[0] for d in deps.values()} == set(progs)
    del futures


def _dense_then_loss(params: Any, x: Any, t: Any) -> Any:
    from tests.models import dense, mse

    with dd.stage(0):
        h = dense(params[0], x)
    with dd.stage(1):
        return mse(h, t)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("holder", ["same client", "another client"])
def test_an_output_held_already_does_not_leave_its_program_out(client2: Any,
                                                               holder: str) -> None:
    """The loss is the only output of stage 1's worker and a client holds its Future:
    computing it with the gradients must still run stage 1's program (the gradients wait
    for it), not leave stage 0's waiting for it until the timeout."""
    from distributed import Client

    params, x, t = data(1)
    other = Client(client2.scheduler.address, set_as_default=False) \
        if holder == "another client" else client2
    try:
        with client2.as_current(), dask.config.set({"dagdiff.direct.timeout": "30s"}):
            loss, grads = dd.value_and_grad(_dense_then_loss, microbatches=2,
                                            schedule="1f1b")(params, x, t)
            held = other.compute(loss)
            first = held.result()
            leaves = jax.tree_util.tree_leaves(grads)
            t0 = time.monotonic()
            got = client2.gather(client2.compute([loss, *leaves]))
            assert time.monotonic() - t0 < 20
            deps = client2.run_on_scheduler(_dependencies, [d.key for d in leaves])
        assert all(len(d) == 2 for d in deps.values()), deps
        want_l, want_g = jax.value_and_grad(_dense_then_loss)(params, x, t)
        np.testing.assert_allclose(first, want_l, rtol=1e-5)
        np.testing.assert_allclose(got[0], want_l, rtol=1e-5)
        close(got[1:], jax.tree_util.tree_leaves(want_g))
        del held
    finally:
        if other is not client2:
            other.close()


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_trainer_steps_in_flight_with_dropped_losses_match_scheduler_dispatch(
        client2: Any) -> None:
    """Many steps submitted at once, each step's loss Future dropped right away (found by
    the Trainer benchmark: the loss tasks were released before they ran)."""
    import optax

    loss_fn = make_loss(2)
    params, x, t = data(2)
    final = {}
    for dispatch in ("direct", "scheduler"):
        tr = dd.Trainer(loss_fn, optax.sgd(0.1), microbatches=4, schedule="1f1b",
                        client=client2, dispatch=dispatch)
        state = tr.init(params)
        for i in range(5):
            state, _ = tr.step(state, x + 0.1 * i, t)   # the loss Future is dropped
        final[dispatch] = tr.params(state)
    close(final["direct"], final["scheduler"])


def _exit_process() -> None:
    import os
    import threading

    threading.Timer(0.1, os._exit, (1,)).start()


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_lost_mid_step_fails_the_step_in_seconds() -> None:
    """The worker of stage 1 dies while the step runs: its program is not run again on
    the replacement, stage 0 notices that its producer is gone, and the caller gets a
    DirectDispatchError long before the 600 s wait timeout; the same step built again
    computes, and so does the next one.
    (resident=False: with parameters scattered to the lost worker Dask itself cancels
    the step at once, "lost scattered data".)"""
    from distributed import Client

    from dagdiff.examples.simulated import sleepy_pipeline

    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True)
    client = Client(cluster, set_as_default=False)
    try:
        fn = sleepy_pipeline(2, 0.5)
        params = [jnp.float32(1.0)] * 2
        with client.as_current():
            loss, grads = dd.value_and_grad(fn, microbatches=4, schedule="1f1b",
                                            resident=False)(params, jnp.ones((4, 4)))
            futures = client.compute([loss, grads])
            deadline = time.time() + 30
            while sum(client.run(_running).values()) < 2 and time.time() < deadline:
                time.sleep(0.05)
            slots = dd.cluster.info.slot_names(client)
            victim = next(a for a, name in slots.items() if name.endswith("1"))
            t0 = time.perf_counter()
            client.run(_exit_process, workers=[victim])
            with pytest.raises(dd.DirectDispatchError, match="lost or restarted"):
                client.gather(futures)
            assert time.perf_counter() - t0 < 60
            del futures
            client.wait_for_workers(2, timeout=60)
            # the same step, built again for the new worker set (new keys), computes
            loss, grads = dd.value_and_grad(fn, microbatches=4, schedule="1f1b",
                                            resident=False)(params, jnp.ones((4, 4)))
            got_l, got_g = client.compute([loss, grads], sync=True)
            assert_matches_jax(fn, (params, jnp.ones((4, 4))), got_l, got_g)
            p2 = [jnp.float32(2.0)] * 2
            fast = sleepy_pipeline(2, 0.0)
            loss, grads = dd.value_and_grad(fast, microbatches=4, schedule="1f1b")(
                p2, jnp.ones((4, 4)))
            got_l, got_g = client.compute([loss, grads], sync=True)
        assert_matches_jax(fast, (p2, jnp.ones((4, 4))), got_l, got_g)
    finally:
        client.close()
        cluster.close()


def test_only_the_leaves_a_remote_worker_reads_are_sent() -> None:
    """A VJP result holds the weight gradients (read by the stage's accumulator) and
    the input cotangent (read by the previous stage); only the latter travels."""
    from dagdiff.runtime.tasks import leaves_read

    loss_fn = make_loss(2)
    params, x, t = data(2)
    loss, _ = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b", fuse=False)(
        params, x, t)
    dsk = dict(loss.__dask_graph__())
    vjp1 = next(k for k in dsk if k.startswith("vjp_dense") and "-s1-m0" in k)
    vjp0 = next(k for k in dsk if k.startswith("vjp_dense") and "-s0-m0" in k)
    read0 = leaves_read(dsk[vjp0])[vjp1]       # stage 0's VJP reads one leaf of stage 1's
    assert read0 is not None and len(read0) == 1
    value = tuple(jnp.full((2, 2), float(i)) for i in range(3))
    (i,) = read0
    wire = pack(value, read0)["items"]
    assert [w is None for w in wire] == [j != i for j in range(3)]
    np.testing.assert_array_equal(unpack(wire[i]), np.full((2, 2), float(i)))
    assert all(w is not None for w in pack(value, None)["items"])


def _fragile_fwd(w: Any, x: Any) -> Any:
    x, w = np.asarray(x), np.asarray(w)
    if np.any(np.abs(x) > 100):
        raise RuntimeError("fragile: input too large")
    return x @ w, (w, x)


def _fragile_bwd(res: Any, ct: Any) -> Any:
    w, x = res
    ct = np.asarray(ct)
    return x.T @ ct, ct @ w.T


fragile = dd.custom_layer(_fragile_fwd, _fragile_bwd, name="fragile")


@dd.layer
def _linear(w: Any, x: Any) -> Any:
    return x @ w


def fragile_loss(params: Any, x: Any, t: Any) -> Any:
    """Two stages: a linear layer, then `fragile` (fails on a worker for large inputs)."""
    with dd.stage(0):
        h = _linear(params[0], x)
    with dd.stage(1):
        return _mse(fragile(params[1], h), t)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_failed_trainer_step_fails_every_stage_and_the_next_step(client2: Any) -> None:
    """Stage 1 fails; stage 0 has finished its own actions, but its new parameters must
    not come out as if the step had worked (the programs' closing exchange), and the
    next step fails too instead of waiting for stage 1; all with stage 1's exception."""
    import optax

    params = [jnp.eye(8), jnp.eye(8)]
    ok, bad = jnp.ones((8, 8)), jnp.full((8, 8), 1000.0)
    tr = dd.Trainer(fragile_loss, optax.sgd(0.01), microbatches=2, schedule="1f1b",
                    client=client2, dispatch="direct")
    state = tr.init(params, ok, ok)
    state, l1 = tr.step(state, ok, ok)
    state, l2 = tr.step(state, bad, ok)
    failed = state
    state, l3 = tr.step(state, ok, ok)
    assert np.isfinite(l1.result(timeout=60))
    # the layer's own exception on every stage, whichever Dask reports (stage 0's
    # program fails because stage 1's did: it raises stage 1's error again, not a
    # dd.UpstreamError, so `except RuntimeError` sees one type)
    failures = [l2, *failed.placed.values(), l3]
    assert len(failed.placed) == 2
    for fut in failures:
        with pytest.raises(RuntimeError, match="fragile: input too large") as e:
            fut.result(timeout=60)
        assert type(e.value) is RuntimeError, repr(e.value)
    assert _waiting(client2) == 0


def _spy_graphs(monkeypatch: Any, module: Any) -> list[dict[str, Any]]:
    """Every graph `module` submits (its `submit`), in order."""
    graphs: list[dict[str, Any]] = []
    real = module.submit

    def submit(client: Any, graph: Any, keys: Any) -> Any:
        graphs.append(dict(graph))
        return real(client, graph, keys)

    monkeypatch.setattr(module, "submit", submit)
    return graphs


def _two_stage_loss(params: Any, x: Any, t: Any) -> Any:
    with dd.stage(0):
        h = _linear(params[0], x)
    with dd.stage(1):
        return _mse(_linear(params[1], h), t)


def _optax_reference(opt: Any, params: Any, batches: list[Any]) -> tuple[Any, list[float]]:
    """Plain JAX + optax over `batches`: the final parameters and each step's loss."""
    import optax

    p, s, losses = params, opt.init(params), []
    for x, t in batches:
        loss, g = jax.value_and_grad(_two_stage_loss)(p, x, t)
        u, s = opt.update(g, s, p)
        p = optax.apply_updates(p, u)
        losses.append(float(loss))
    return p, losses


def _two_stage_job(seed: int, n: int) -> tuple[list[Any], list[tuple[Any, Any]]]:
    key = jax.random.PRNGKey(seed)
    params = [jax.random.normal(key, (8, 8)) * 0.3, jax.random.normal(key, (8, 8)) * 0.2]
    batches = [(jax.random.normal(jax.random.fold_in(key, i), (8, 8)),
                jax.random.normal(jax.random.fold_in(key, 50 + i), (8, 8))) for i in range(n)]
    return params, batches


def _program_states(dask_scheduler: Any) -> dict[str, str]:
    return {str(k): ts.state for k, ts in dask_scheduler.tasks.items()
            if str(k).startswith("prog_")}


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_step_submitted_again_while_one_program_task_lingers_runs_as_one(
        client2: Any) -> None:
    """The same Trainer step submitted a second time (a fit run again from the same
    state, as a benchmark or a re-run cell does) after the client let go of all of the
    first submission but one new parameter: the scheduler keeps that parameter's
    program task, released, with its first graph (the first build's run id), and makes
    the other program from the new graph. Both must run as one run of the step: they
    did not (each waited for the other until the timeout, the hang of the 8 x 1024
    benchmark), because the scheduler gave each graph's run id its own fresh one."""
    import optax

    params, batches = _two_stage_job(5, 2)
    with dask.config.set({"dagdiff.direct.timeout": "8s"}):
        tr = dd.Trainer(_two_stage_loss, optax.sgd(0.05), microbatches=2,
                        schedule="1f1b", client=client2)
        state = tr.init(params)
        state, loss = tr.step(state, *batches[0])
        loss.result(timeout=60)
        first, loss = tr.step(state, *batches[1])
        loss.result(timeout=60)
        kept = first.placed[(0, 1)]                # stage 1's new parameters, held
        other, loss = tr.step(state, *batches[0])  # the trainer's latest is another
        loss.result(timeout=60)
        del first, loss, other
        time.sleep(0.5)                            # the releases reach the scheduler
        token = kept.key.rsplit("-", 1)[1]
        progs = {k: v for k, v in client2.run_on_scheduler(_program_states).items()
                 if k.endswith(token)}
        assert progs == {f"prog_slot1-n1-{token}": "released"}, progs   # it lingers
        again, loss = tr.step(state, *batches[1])  # the same keys, a new graph
        assert kept.key in {f.key for f in again.placed.values()}
        assert np.isfinite(loss.result(timeout=60))
    p, want = _optax_reference(optax.sgd(0.05), params, batches)
    np.testing.assert_allclose(float(loss.result()), want[1], rtol=1e-5)
    close(tr.params(again), p)


@pytest.mark.distributed
@pytest.mark.parametrize("chain", [True, False])
def test_a_trainer_step_takes_the_state_of_the_step_before_in_place(
        client2: Any, chain: bool, monkeypatch: Any) -> None:
    """Trainer steps in flight: each step's programs read the new state the step before
    made on their worker straight from that program (no Dask dependency on it, so the
    scheduler sends them at once: ``dagdiff.direct.chain-steps``, the default), and the
    losses and parameters equal plain JAX + optax. A step submitted twice from one state
    (same keys: Dask runs one of the two submissions) still feeds the next step."""
    import optax

    import dagdiff.train.trainer as trainer_module

    graphs = _spy_graphs(monkeypatch, trainer_module)
    loss_fn = _two_stage_loss
    params, batches = _two_stage_job(0, 4)
    opt = optax.adam(1e-2)
    with dask.config.set({"dagdiff.direct.chain-steps": chain}):
        tr = dd.Trainer(loss_fn, opt, microbatches=2, schedule="1f1b", client=client2,
                        dispatch="direct")
        state = tr.init(params)
        state, l0 = tr.step(state, *batches[0])
        state1a, l1a = tr.step(state, *batches[1])
        state1, l1 = tr.step(state, *batches[1])        # the same step again
        assert l1.key == l1a.key
        state2, l2 = tr.step(state1, *batches[2])
        state3, l3 = tr.step(state2, *batches[3])
        losses = [float(x.result(timeout=60)) for x in (l0, l1a, l1, l2, l3)]
    programs = [t for t in graphs[-1].values() if getattr(t, "func", None) is run_program]
    assert len(programs) == 2
    from_before = {str(t.key): [d for d in t.dependencies if str(d).startswith("update_")]
                   for t in programs}
    if chain:
        assert not any(from_before.values()), from_before
    else:
        assert all(from_before.values()), from_before
    p, want = _optax_reference(opt, params, batches)
    np.testing.assert_allclose(losses, [want[0], want[1], want[1], want[2], want[3]],
                               rtol=1e-5)
    close(tr.params(state3), p)


@pytest.mark.distributed
def test_fit_in_windows_runs_k_steps_as_one_task_per_worker(client2: Any,
                                                            monkeypatch: Any) -> None:
    """`trainer.fit(batches, window=3)`: 7 steps submitted as windows of 3, 3 and 1; a
    window's graph has one program task per worker (running its 3 steps' programs), one
    run id, one loss output and the last step's state; each step's loss and the final
    parameters equal plain JAX + optax (and window=1's), and the state fit returns steps
    on as usual."""
    import optax

    import dagdiff.train.window as window_module
    from dagdiff.runtime.direct.runtime import run_programs

    graphs = _spy_graphs(monkeypatch, window_module)
    loss_fn = _two_stage_loss
    params, batches = _two_stage_job(1, 8)
    opt = optax.adam(1e-2)
    tr = dd.Trainer(loss_fn, opt, microbatches=2, schedule="1f1b", client=client2)
    state, losses = tr.fit(batches[:7], params=params, progress=False, window=3)
    assert len(graphs) == 2                       # the two full windows; the last step alone
    for g in graphs:
        tasks = [t for t in g.values() if hasattr(t, "func")]
        windows = [t for t in tasks if t.func is run_programs]
        assert len(windows) == 2 and all(t.args[1] == 3 for t in windows)
        assert not any(t.func is run_program for t in tasks)
        assert len(tasks) == 2 + 1 + 2            # windows, losses, state picks
        # the windows carry one run id, and no task makes it
        assert len({t.args[2] for t in windows}) == 1 and type(windows[0].args[2]) is \
            RunNonce
    state, more = tr.fit(batches[7:], state=state, progress=False, window=3)
    p, want = _optax_reference(opt, params, batches)
    np.testing.assert_allclose(losses + more, want, rtol=1e-5)
    close(tr.params(state), p)
    one = dd.Trainer(loss_fn, opt, microbatches=2, schedule="1f1b", client=client2)
    _, losses1 = one.fit(batches, params=params, progress=False)
    np.testing.assert_allclose(losses + more, losses1, rtol=1e-6)
    with pytest.raises(dd.ArgumentError, match="window"):
        tr.fit(batches, state=state, progress=False, window=0)
    # the state first, as trainer.step takes it: a clear error, not tqdm's TypeError
    with pytest.raises(dd.ArgumentError, match=r"fit\(batches, state=state\)"):
        tr.fit(state, batches)                                  # type: ignore[arg-type]
    with pytest.raises(dd.ArgumentError, match="steps must be an int"):
        tr.fit(batches, batches, progress=True)                 # type: ignore[arg-type]


def _aux_loss(params: Any, scale: Any, x: Any, t: Any) -> Any:
    with dd.stage(0):
        h = _linear(params[0], x)
    with dd.stage(1):
        y = _linear(params[1], h)
        return _mse(y, t) * scale["s"], {"y": y}


@pytest.mark.distributed
def test_step_compute_gathers_each_workers_outputs_in_one_task(client2: Any,
                                                               monkeypatch: Any) -> None:
    """`step.compute` (values on the client): the graph it submits has one task per
    worker returning that worker's outputs (not one task per gradient leaf), the values
    equal `jax.value_and_grad`'s (aux per microbatch, two differentiated arguments, a
    leaf that is not differentiated), and computing the same step twice gives them
    again."""
    import dagdiff.build as build_module
    from dagdiff.runtime.direct.graph import _output, _outputs_of, run_gathered

    graphs = _spy_graphs(monkeypatch, build_module)
    params, batches = _two_stage_job(3, 1)
    x, t = batches[0]
    scale = {"s": jnp.asarray(1.5), "n": 3}
    step = dd.value_and_grad(_aux_loss, argnums=(0, 1), has_aux=True, microbatches=2,
                             schedule="1f1b")
    nonces: list[str] = []
    for _ in range(2):                               # the same step twice: a new run
        (loss, aux), (g_params, g_scale) = step.compute(params, scale, x, t, client=client2)
        tasks = [v for v in graphs[-1].values() if hasattr(v, "func")]
        assert not any(v.func in (_output, _outputs_of, run_program) for v in tasks)
        # each worker's program hands back its outputs itself: the loss, 2 microbatches'
        # aux, 3 gradient leaves; no task between a program and the client
        groups = [v for v in tasks if v.func is run_gathered]
        assert len(groups) == 2 and sum(v.args[1] for v in groups) == 1 + 2 + 3
        assert {g.args[2].where for g in groups} == {"slot0", "slot1"}
        # no nonce task: the programs run under one fresh nonce given in the graph
        assert len(tasks) == 2 and len({g.args[3] for g in groups}) == 1
        nonces.append(groups[0].args[3])
        halves = [_aux_loss(params, scale, x[:4], t[:4]), _aux_loss(params, scale, x[4:],
                                                                     t[4:])]
        want, want_g = jax.value_and_grad(
            lambda p, s: (_aux_loss(p, s, x[:4], t[:4])[0]
                          + _aux_loss(p, s, x[4:], t[4:])[0]) / 2, argnums=(0, 1))(
            params, {"s": scale["s"]})
        np.testing.assert_allclose(loss, want, rtol=1e-6)
        close(g_params, want_g[0])
        np.testing.assert_allclose(g_scale["s"], want_g[1]["s"], rtol=1e-6)
        assert g_scale["n"] is None
        for got, (_, a) in zip(aux, halves):
            np.testing.assert_allclose(got["y"], a["y"], rtol=1e-6)
    assert nonces[0] != nonces[1]


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_the_same_step_computed_in_flight_together_gives_jax_values(client2: Any) -> None:
    """`step.compute` of one step from four threads at once, on two batches (each batch
    twice): every call runs its own programs and gets `jax.value_and_grad`'s values, and
    nothing is left waiting on the cluster."""
    from concurrent.futures import ThreadPoolExecutor

    params, batches = _two_stage_job(3, 2)
    step = dd.value_and_grad(_two_stage_loss, microbatches=2, schedule="1f1b")
    jobs = [batches[i % 2] for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda b: step.compute(params, *b, client=client2), jobs))
    for (x, t), (loss, grads) in zip(jobs, got):
        want, want_g = jax.value_and_grad(_two_stage_loss)(params, x, t)
        np.testing.assert_allclose(loss, want, rtol=1e-6)
        close(grads, want_g)
    assert _waiting(client2) == 0


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_gathered_step_failing_on_one_worker_gives_no_outputs_of_the_other(
        client2: Any, monkeypatch: Any) -> None:
    """`step.compute` gathers each worker's outputs from its own program alone: when
    stage 1 fails after stage 0 ran all its actions, stage 0's outputs fail too (its
    program's closing exchange), not hand back gradients of a step that failed."""
    seen: list[Any] = []
    real = client2.get

    def get(dsk: Any, keys: Any, **kwargs: Any) -> Any:
        futures = real(dsk, keys, **{**kwargs, "sync": False})
        seen.append(futures)
        return client2.gather(futures) if kwargs.get("sync", True) else futures

    monkeypatch.setattr(client2, "get", get)
    params = [jnp.eye(8), jnp.eye(8)]
    step = dd.value_and_grad(fragile_loss, microbatches=2, schedule="1f1b")
    with pytest.raises(Exception, match="fragile: input too large"):
        step.compute(params, jnp.full((8, 8), 1000.0), jnp.ones((8, 8)), client=client2)
    futures = seen[-1]
    assert len(futures) == 2                        # one group per worker
    for fut in futures:
        with pytest.raises(Exception, match="fragile: input too large"):
            fut.result(timeout=60)
    del futures, seen[:]
    x, t = jnp.full((8, 8), 0.5), jnp.ones((8, 8))       # the same step, a good batch
    loss, grads = step.compute(params, x, t, client=client2)
    want, want_g = jax.value_and_grad(
        lambda p: jnp.mean((x @ p[0] @ p[1] - t) ** 2))(params)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    close(grads, want_g)
    assert _waiting(client2) == 0


@pytest.mark.distributed
@pytest.mark.parametrize("seconds,size", [(60.0, 64), (1e-6, 1)])
def test_fit_chooses_its_window_from_the_first_steps_times(client2: Any, monkeypatch: Any,
                                                           seconds: float, size: int) -> None:
    """`trainer.fit` (window="auto", the default): the first steps go one by one; then a
    window spans about dask config ``dagdiff.fit.window-seconds`` of steps, at most 64:
    with a minute, windows of 64 from then on; with a microsecond, every step alone. A
    second fit (the next epoch) starts with that choice, and one aiming at another time
    chooses again. The losses and parameters equal plain JAX + optax either way."""
    import optax

    import dagdiff.train.window as window_module
    from dagdiff.runtime.direct.runtime import run_programs

    graphs = _spy_graphs(monkeypatch, window_module)
    params, batches = _two_stage_job(4, 24)
    opt = optax.sgd(0.05)
    tr = dd.Trainer(_two_stage_loss, opt, microbatches=2, schedule="1f1b", client=client2)
    with dask.config.set({"dagdiff.fit.window-seconds": seconds}):
        state, losses = tr.fit(batches, params=params, progress=False)
    # the windows submitted (steps alone are not): each with one task per worker
    sizes = [[t.args[1] for t in g.values() if getattr(t, "func", None) is run_programs]
             for g in graphs]
    if size == 1:
        assert sizes == []
    else:
        # steps 0-6 alone (step 6's submission waits for the fifth step's end: the first,
        # with compilation, then 3 gaps timed), then 7-23 as one window (of the 64 chosen)
        assert sizes == [[17, 17]]
    p, want = _optax_reference(opt, params, batches)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    close(tr.params(state), p)

    del graphs[:]
    with dask.config.set({"dagdiff.fit.window-seconds": seconds}):
        state, more = tr.fit(batches[:17], state=state, progress=False)
    sizes = [[t.args[1] for t in g.values() if getattr(t, "func", None) is run_programs]
             for g in graphs]
    assert sizes == ([] if size == 1 else [[17, 17]])           # all 17 in one window
    other = 1e-6 if size == 64 else 60.0
    del graphs[:]
    with dask.config.set({"dagdiff.fit.window-seconds": other}):
        state, last = tr.fit(batches[:8], state=state, progress=False)
    assert not graphs                       # its first steps are timed again: all alone
    p, want = _optax_reference(opt, params, batches + batches[:17] + batches[:8])
    np.testing.assert_allclose(losses + more + last, want, rtol=1e-5)
    close(tr.params(state), p)


def test_an_auto_window_holds_at_most_64_mib_of_batches() -> None:
    """`fit`'s auto window: as many steps as span its target time, at most 64, and at
    most `AutoWindow.MAX_BYTES` (64 MiB) of batch arrays (a window's batches travel in
    its graph): 64 steps of 1 MiB batches (or of 0.5 MiB), 4 of 16 MiB, 1 of 100 MiB."""
    from dagdiff.train.fit import AutoWindow

    for mib, want in ((0.5, 64), (1, 64), (16, 4), (100, 1)):
        auto = AutoWindow(seconds=60.0)
        x = np.zeros((int(mib * 4), 2**16), np.float32)  # `mib` MiB (calloc: untouched)
        kept: dict[Any, int] = {}
        auto.start(kept, ("batch", mib), (x,))
        for _ in range(AutoWindow.TIMED + 2):
            auto.step_ended()
        assert auto.chosen and auto.size == want, mib
        assert kept == {(("batch", mib), 60.0): want}


def test_an_auto_window_grows_once_when_windowed_steps_are_faster() -> None:
    """Timed on one-by-one steps of 100 ms, a 0.5 s window is 5 steps; when its windows
    then end every 40 ms (8 ms a step: Dask's fixed cost amortized), it grows once to
    the 62 steps that span 0.5 s and keeps that for later fits; slower windowed steps
    keep it; where windowed steps take 2 ms, it grows to the most steps (64)."""
    from dagdiff.train.fit import AutoWindow

    now = [0.0]
    for window_ms, want in ((40.0, 62), (600.0, 5), (10.0, 64)):
        now[0] = 0.0
        auto = AutoWindow(seconds=0.5, clock=lambda: now[0])
        kept: dict[Any, int] = {}
        auto.start(kept, "sig", (np.zeros(4),))
        for _ in range(AutoWindow.TIMED + 2):          # one by one, 100 ms apart
            now[0] += 0.1
            auto.step_ended()
        assert auto.chosen and auto.size == 5 and kept == {("sig", 0.5): 5}
        for _ in range(4):                              # windows of 5, ending together
            now[0] += window_ms / 1e3
            for _ in range(5):
                auto.step_ended()
        assert auto.refined and auto.size == want and kept == {("sig", 0.5): want}


@pytest.mark.distributed
def test_fit_windows_with_replicas_average_each_steps_loss_across_workers(
        client4: Any, monkeypatch: Any) -> None:
    """`trainer.fit(window=4)` with 2 replicas of 2 stages: the windows run (one task per
    worker for 4 steps), each step's loss is the mean of the replicas' losses, read from
    the two loss workers' window tasks, and the losses and parameters equal plain JAX +
    optax on the whole batch."""
    import optax

    import dagdiff.train.window as window_module
    from dagdiff.runtime.direct.runtime import run_programs

    graphs = _spy_graphs(monkeypatch, window_module)
    params, batches = _two_stage_job(5, 8)
    opt = optax.adam(1e-2)
    tr = dd.Trainer(_two_stage_loss, opt, microbatches=2, schedule="1f1b", replicas=2,
                    client=client4)
    state, losses = tr.fit(batches, params=params, progress=False, window=4)
    assert len(graphs) == 2
    for g in graphs:
        windows = [t for t in g.values() if getattr(t, "func", None) is run_programs]
        assert len(windows) == 4 and all(t.args[1] == 4 for t in windows)
    p, want = _optax_reference(opt, params, batches)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    close(tr.params(state), p)


@pytest.mark.distributed
def test_a_windows_steps_keep_their_losses_once_one_step_took_them(client2: Any) -> None:
    """The losses of a window's steps come from one output: once a step took them, the
    other steps' losses read them from there, even when Dask lost that output since (its
    worker removed: the future goes back to pending and `fit` cancels it). Before, the
    second step of the window then failed and `fit` tried to restore a state made inside
    the window."""
    from dagdiff.train.recovery import WindowLoss

    fut = client2.submit(lambda: (1.5, 2.5, 3.5), key="window-losses-test", pure=False)
    got: list[Any] = []
    first, second = (WindowLoss(fut.key, client2, 7 + i, (), i, got) for i in range(2))
    assert first.result(timeout=30) == 1.5
    client2.cancel([fut])
    with pytest.raises(Exception):
        fut.result(timeout=30)
    assert second.result(timeout=30) == 2.5
    alone = WindowLoss(fut.key, client2, 9, (), 2)    # not sharing them: the cancelled key
    with pytest.raises(Exception):
        alone.result(timeout=30)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("window", [3, 8])
def test_a_layer_failing_inside_a_window_keeps_the_steps_before_it(client2: Any,
                                                                   window: int) -> None:
    """A layer fails in step 4 of 7, inside a window (window=3: the second window,
    steps 3-5; window=8: the one window): fit raises the layer's own exception with one
    note saying 4 steps finished, and goes on from step 4's state: the steps of the
    window before the failing one are not lost with it (README: "the steps before it end
    first, even those in its window"). The final parameters equal optax's over the good
    batches. The same failing fit run again from the same state says so again, once."""
    import optax

    params, good = _two_stage_job(3, 6)
    bad = (jnp.full((8, 8), 1000.0), good[0][1])
    batches = [*good[:4], bad, *good[4:6]]
    opt = optax.sgd(0.05)
    tr = dd.Trainer(fragile_loss, opt, microbatches=2, schedule="1f1b", client=client2)
    state = tr.init(params)
    for attempt in range(2):
        with pytest.raises(RuntimeError, match="fragile: input too large") as e:
            tr.fit(batches, state=state, progress=False, window=window)
        assert type(e.value) is RuntimeError, repr(e.value)
        notes = [n for n in getattr(e.value, "__notes__", [])
                 if n.startswith("dagdiff: Trainer.fit stopped")]
        assert len(notes) == 1 and "after 4 finished step(s)" in notes[0], notes
        del e                                    # its traceback holds this frame
    after, more = tr.fit(good[4:6], progress=False, window=window)     # from step 4
    assert after.step == 6 and len(more) == 2
    p, want = _optax_reference(opt, params, good[:6])
    np.testing.assert_allclose(more, want[4:], rtol=1e-5)
    close(tr.params(after), p)


@pytest.mark.distributed
def test_a_fit_run_again_in_other_windows_gives_its_outputs_keys_of_their_own(
        client2: Any, monkeypatch: Any) -> None:
    """The same steps from the same state grouped otherwise (a re-run cell whose
    window="auto" chose another size, or window=3 then 4 then 1), or grouped alike but
    reading their first state otherwise (in place on its worker while it is the newest
    state, else as a Dask dependency): each window's programs, loss and state have keys
    of their own, so the scheduler never sees one key with two different tasks
    (distributed warns of it: "Detected different `run_spec`"), and every run gives the
    same losses and parameters."""
    import logging

    import optax

    import dagdiff.train.step_graph as step_graph_module
    import dagdiff.train.window as window_module

    graphs = _spy_graphs(monkeypatch, window_module)
    # the Trainer remembers where the newest state values come from (256): with 8, the
    # start state is read in place by the first fit, as a dependency by the last
    monkeypatch.setattr(step_graph_module, "SOURCES_KEPT", 8)

    params, batches = _two_stage_job(6, 7)
    opt = optax.sgd(0.05)
    tr = dd.Trainer(_two_stage_loss, opt, microbatches=2, schedule="1f1b", client=client2)
    runs = []
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore
    log = logging.getLogger("distributed.scheduler")   # the in-process scheduler's
    log.addHandler(handler)
    start, _ = tr.fit(batches[:1], params=params, progress=False)   # a placed state
    try:
        for window in (3, 4, 1, 3):
            state, losses = tr.fit(batches, state=start, progress=False, window=window)
            runs.append((tr.params(state), losses))
    finally:
        log.removeHandler(handler)
    assert not [m for m in seen if "run_spec" in m]
    tasks: dict[str, Any] = {}
    for g in graphs:                          # one key, one task, in every submission
        for key, t in g.items():
            if key in tasks:
                assert tasks[key] == (t.func, set(t.dependencies)), key
            tasks[key] = (t.func, set(t.dependencies))
    p0, want = _optax_reference(opt, params, batches[:1] + batches)
    close(runs[0][0], p0)
    np.testing.assert_allclose(runs[0][1], want[1:], rtol=1e-5)
    for p, losses in runs[1:]:
        close(p, runs[0][0])
        np.testing.assert_allclose(losses, runs[0][1], rtol=1e-6)
