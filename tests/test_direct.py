"""Direct dispatch: one program per worker in the order of a simulated run, values worker
to worker over distributed's comms, and failures that reach the caller instead of hanging."""
from __future__ import annotations

import contextlib
import pickle
import time
from typing import Any

import dask.sizeof
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dagdiff as dd
from dagdiff.runtime.direct import Action as DirectAction, Program, linearize, run_program
from dagdiff.runtime.direct import runtime as rt_mod
from dagdiff.runtime.direct.messages import Value, pack
from dagdiff.schedules import Action
from tests.models import close, data, make_loss


# --- the worker order (pure) ------------------------------------------------------------

def test_linearize_keeps_schedule_order_and_places_small_tasks_when_ready() -> None:
    # two workers, two microbatches: F/B actions with schedule priorities, plus a split
    # task (no inputs), a loss select and accumulators without priorities
    deps = {
        "split0": [], "split1": [],
        "F00": ["split0"], "F01": ["split1"], "F10": ["F00"], "F11": ["F01"],
        "loss0": ["F10"], "loss1": ["F11"],
        "B10": ["F10"], "B11": ["F11"], "B00": ["B10", "F00"], "B01": ["B11", "F01"],
        "acc0": ["B00"], "acc1": ["B01", "acc0"],
    }
    worker = {k: ("w1" if k[1:2] == "1" and k[0] in "FB" or k.startswith("loss") else "w0")
              for k in deps}
    # 1F1B on 2 workers, 2 microbatches: w0 F0 F1 B0 B1, w1 F0 B0 F1 B1
    prio = {"F00": 4, "F01": 3, "B00": 2, "B01": 1, "F10": 4, "B10": 3, "F11": 2, "B11": 1}
    order = linearize(deps, worker, prio)
    assert [k for k in order["w0"] if k in prio] == ["F00", "F01", "B00", "B01"]
    assert [k for k in order["w1"] if k in prio] == ["F10", "B10", "F11", "B11"]
    # no inputs: right before the first task that needs them
    assert order["w0"][:4] == ["split0", "F00", "split1", "F01"]
    assert order["w1"] == ["F10", "loss0", "B10", "F11", "loss1", "B11"]
    w0 = order["w0"]
    assert w0.index("acc0") == w0.index("B00") + 1             # right after its input
    assert w0.index("acc1") == w0.index("B01") + 1


def test_linearize_rejects_an_order_that_would_deadlock() -> None:
    deps = {"F0": [], "F1": ["F0"], "B1": ["F1"], "B0": ["B1", "F0"]}
    worker = {"F0": "w0", "B0": "w0", "F1": "w1", "B1": "w1"}
    # w0 wants its backward before its forward: B0 needs B1 needs F1 needs F0
    with pytest.raises(dd.DirectDispatchError, match="cannot run") as e:
        linearize(deps, worker, {"B0": 2, "F0": 1, "F1": 2, "B1": 1})
    assert "w0 at B0" in str(e.value)


def test_plan_programs_is_pure_and_sends_only_what_is_read() -> None:
    """The planning module takes plain dicts (no Dask): two workers, one microbatch."""
    from dagdiff.runtime.direct.plan import Consumers, plan_programs

    deps = {"x": [], "F0": ["x"], "F1": ["F0"], "B1": ["F1"], "B0": ["B1", "F0"],
            "acc0": ["B0"], "loss": ["F1"]}
    where = {"F0": "w0", "B0": "w0", "acc0": "w0", "F1": "w1", "B1": "w1", "x": None,
             "loss": "w1"}
    reads = {"B0": {"B1": frozenset({0}), "F0": None}, "F1": {"F0": None},
             "B1": {"F1": None}, "acc0": {"B0": None}}
    plan = plan_programs(deps, set(deps) - {"x"}, where, {"F0": 2, "B0": 1, "F1": 2, "B1": 1},
                         keep={"loss"}, outputs={"acc0"}, reads=reads)
    w0, w1 = plan.programs
    assert [a.key for a in w0.actions] == ["F0", "B0", "acc0"]
    assert [a.key for a in w1.actions] == ["F1", "B1"]
    assert w0.statics == ("x",)
    b1 = w1.actions[1]
    assert b1.remote == (Consumers("w0", 1, frozenset({0})),)   # one leaf travels
    assert w1.actions[0].export                                  # read by the loss task
    assert w0.actions[2].export and not w0.actions[0].export
    assert plan.direct == frozenset({"F0", "B0", "acc0", "F1", "B1"})


def test_a_program_result_is_a_stub_on_the_wire_and_whole_on_disk() -> None:
    """Another worker's output depends on a program's result for order alone: over a
    comm (a recipient in the context) no values travel; spilled, it keeps them."""
    import asyncio

    from distributed.comm.utils import from_frames, to_frames
    from distributed.protocol import deserialize_bytes, serialize_bytelist, to_serialize

    from dagdiff.runtime.direct.results import ProgramResult
    from dagdiff.runtime.serialize import register

    register()
    value = np.arange(1 << 16, dtype=np.float32)
    result = ProgramResult("prog_slot0-n0-abc", {"acc-x": value, "loss-y": 1.5})
    assert dask.sizeof.sizeof(result) >= value.nbytes

    async def wire(context: Any) -> Any:
        frames = await to_frames({"data": to_serialize(result)}, context=context)
        return sum(len(memoryview(f)) for f in frames), (await from_frames(frames))["data"]

    nbytes, stub = asyncio.run(wire({"sender": {}, "recipient": {"address": "tcp://w1"}}))
    assert stub.stub and stub.program == result.program and nbytes < 2000
    with pytest.raises(dd.DirectDispatchError, match="stays on the worker of prog_slot0"):
        stub.value("acc-x")
    for back in (deserialize_bytes(b"".join(map(bytes, serialize_bytelist(result)))),
                 asyncio.run(wire(None))[1], pickle.loads(pickle.dumps(result))):
        assert not back.stub and back.value("loss-y") == 1.5
        np.testing.assert_array_equal(back.value("acc-x"), value)
    with pytest.raises(dd.DirectDispatchError, match="exported no value nope"):
        result.value("nope")


def test_the_planning_modules_import_nothing_from_dask_or_jax() -> None:
    import ast
    import pathlib

    import dagdiff

    root = pathlib.Path(dagdiff.__file__).parent
    for rel in ("runtime/direct/plan.py", "core/dag.py", "errors.py"):
        tree = ast.parse((root / rel).read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                  and n.level == 0}
        assert not {m.split(".")[0] for m in names} & {"dask", "distributed", "jax"}, rel


class BackwardFirst(dd.Schedule):
    """A broken user schedule: the last stage lists its backwards before its forwards."""

    name = "backward-first"

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        f = [Action("F", i) for i in range(microbatches)]
        b = [Action("B", i) for i in range(microbatches)]
        return [f + b for _ in range(num_stages - 1)] + [b + f]


@pytest.mark.distributed
def test_a_schedule_that_cannot_run_fails_when_building(client2: Any) -> None:
    loss_fn = make_loss(2)
    params, x, t = data(2)
    with client2.as_current():
        with pytest.raises(dd.ScheduleError, match="deadlock") as e:
            dd.value_and_grad(loss_fn, microbatches=2, schedule=BackwardFirst())(params, x, t)
    assert "worker 1 at B0" in str(e.value)


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


def _probe_every(seconds: float, after: float | None = None) -> tuple[float, float]:
    old = (rt_mod.PROBE_AFTER, rt_mod.PROBE_EVERY)
    rt_mod.PROBE_AFTER, rt_mod.PROBE_EVERY = seconds, (seconds if after is None else after)
    return old


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
    old = client4.run(_probe_every, 0.001)
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
            client4.run(_probe_every, after, workers=[w])
    assert all(client4.run(_serving).values())


@pytest.mark.distributed
def test_a_step_is_one_program_per_worker_in_schedule_order(client2: Any) -> None:
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
    # stage 0's program (it starts the pipeline) is sent first once the nonce is ready
    (layer,) = loss.__dask_graph__().layers.values()
    prio = {k: layer.annotations["priority"](k) for k in progs}
    lead = next(k for k, p in progs.items()
                if any((i.phase, i.stage) == ("F", 0) for i in map(dd.key_info,
                                                                   (a.key for a in p.actions))))
    assert prio[lead] == max(prio.values()) > min(prio.values()), prio
    for k, prog in progs.items():
        # programs read only the step's inputs, never each other (values go directly)
        assert not set(dsk[k].dependencies) & set(progs), k
        # the step's inputs that are Dask keys (resident parameters) and the run nonce;
        # the batch travels inside the program task (no scattered data: recomputable)
        nonce = next(d for d in dsk[k].dependencies if d.startswith("run_step"))
        resident = {s for s in prog.statics if not s.startswith("input_")}
        assert set(dsk[k].dependencies) == resident | {nonce}
        assert dsk[nonce].dependencies == frozenset()
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


# --- the pieces, on in-process and TCP clusters ------------------------------------------

@pytest.fixture(scope="module")
def inproc() -> Any:
    """A client of a 2-worker in-process cluster (inproc:// comms)."""
    from distributed import Client

    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True,
                               processes=False)
    client = Client(cluster, set_as_default=False)
    from dagdiff.runtime.plugins import ensure_colocation

    ensure_colocation(client)
    yield client
    client.close()
    cluster.close()


def _addresses(client: Any) -> list[str]:
    slots = dd.cluster.info.slot_names(client)
    return sorted(slots, key=slots.__getitem__)


def _submit(client: Any, prog: Program, address: str, nonce: str = "n1") -> Any:
    return client.submit(run_program, prog, nonce, workers=[address], pure=False,
                         allow_other_workers=False)


def test_a_missing_input_times_out_with_the_facts(inproc: Any) -> None:
    from dagdiff.runtime.taskspec import Task, TaskRef

    a0, a1 = _addresses(inproc)
    src = "fwd_dense-s0-m0-n0-abc"
    key = "fwd_dense-s1-m0-n1-abc"
    action = DirectAction(key, Task(key, _identity, TaskRef(src)), ((src, "slot0"),), 0, (),
                          True)
    prog = Program("prog_slot1-n1-abc", "s-test", "slot1", a1, (action,), (), timeout=0.3,
                   members=(("slot0", a0),))
    t0 = time.perf_counter()
    with pytest.raises(dd.DirectDispatchError) as e:
        _submit(inproc, prog, a1).result(timeout=30)
    text = str(e.value)
    assert time.perf_counter() - t0 < 5
    assert f"{key} on slot1 waited 0.3 s for input {src} from slot0" in text
    assert "dagdiff.direct.timeout" in text


def test_a_program_built_for_another_worker_refuses_to_run(inproc: Any) -> None:
    """Dask reruns a lost worker's program on its replacement (a new address): the
    others sent their values to the old one, so it fails at once, saying so."""
    a0, a1 = _addresses(inproc)
    prog = Program("prog_slot1-n1-abc", "s-moved", "slot1", "inproc://gone/1/1", (), (),
                   timeout=60)
    with pytest.raises(dd.DirectDispatchError, match="was lost or restarted since"):
        _submit(inproc, prog, a1).result(timeout=30)


@pytest.mark.distributed
def test_a_dead_producer_is_noticed_while_waiting(client2: Any) -> None:
    from dagdiff.runtime.taskspec import Task, TaskRef

    with socket_closed_port() as port:     # a port nobody listens on any more
        pass
    a0, _ = _addresses(client2)
    old = client2.run(_probe_every, 0.2, workers=[a0])
    try:
        src = "vjp_dense-s1-m0-n1-abc"
        key = "vjp_dense-s0-m0-n0-abc"
        dead = f"tcp://127.0.0.1:{port}"
        action = DirectAction(key, Task(key, _identity, TaskRef(src)), ((src, "slot1"),), 0,
                              (), True)
        prog = Program("prog_slot0-n0-abc", "s-probe", "slot0", a0, (action,), (),
                       timeout=60, members=(("slot1", dead),))
        t0 = time.perf_counter()
        with pytest.raises(dd.DirectDispatchError, match="where nothing listens any more") as e:
            _submit(client2, prog, a0).result(timeout=60)
        assert time.perf_counter() - t0 < 20
        assert f"waits for input {src} from slot1 at {dead}" in str(e.value)
    finally:
        client2.run(_probe_every, *old[a0], workers=[a0])


def _fails(x: Any) -> Any:
    raise ValueError("boom")


@pytest.mark.distributed
def test_a_failed_program_does_not_wait_to_tell_unreachable_consumers(client2: Any) -> None:
    """A failed program queues its error notices and returns: 30 actions whose consumer
    cannot be reached cost nothing."""
    from dagdiff.runtime.direct.runtime import Remote
    from dagdiff.runtime.taskspec import Task

    with socket_closed_port() as port:
        pass
    a0, _ = _addresses(client2)
    dead = f"tcp://127.0.0.1:{port}"
    remote = (Remote("slot1", dead, 1),)
    actions = tuple(DirectAction(f"fwd_dense-s0-m{i}-n0-abc",
                                 Task(f"fwd_dense-s0-m{i}-n0-abc", _fails, i), (), 0,
                                 remote, False) for i in range(30))
    prog = Program("prog_slot0-n0-abc", "s-fail-fast", "slot0", a0, actions, (), timeout=60,
                   members=(("slot1", dead),))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="boom"):
        _submit(client2, prog, a0).result(timeout=60)
    assert time.perf_counter() - t0 < 5


def test_a_run_starts_once_per_worker(inproc: Any) -> None:
    """Dask running the same program of the same run twice on one worker (an in-process
    worker restarted mid-step) must not share the first run's inputs: it refuses."""
    a0, _ = _addresses(inproc)

    def begin(dask_worker: Any) -> None:
        dask_worker.extensions["dagdiff"]._state("s-twice/n1", start=True)

    inproc.run(begin, workers=[a0])
    prog = Program("prog_slot0-n0-abc", "s-twice", "slot0", a0, (), (), timeout=1)
    with pytest.raises(dd.DirectDispatchError, match="already started on"):
        _submit(inproc, prog, a0).result(timeout=30)
    # a new run of the same step (a new nonce: the step computed again) runs
    assert _submit(inproc, prog, a0, nonce="n2").result(timeout=30) == {}


def test_unstarted_runs_are_kept_for_twice_their_timeout(monkeypatch: Any) -> None:
    class Worker:
        address = "inproc://x/1/1"
        handlers: dict[str, Any] = {}
        extensions: dict[str, Any] = {}

    monkeypatch.setattr(rt_mod, "STALE_AFTER", 10.0)
    rt = rt_mod.DirectRuntime(Worker())
    with dask_config({"dagdiff.direct.timeout": "100s"}):
        long = rt._state("s-long/n")                     # kept 200 s
    short_cfg = {"dagdiff.direct.timeout": "1s"}
    with dask_config(short_cfg):
        short = rt._state("s-short/n")                   # kept 10 s
    assert short is not None and long is not None
    short.created -= 50
    long.created -= 50
    rt._finish("s-other/n", "ended")                     # sweeps
    assert "s-short/n" not in rt._runs
    assert rt._runs["s-long/n"] is long


def dask_config(values: dict[str, Any]) -> Any:
    import dask

    return dask.config.set(values)


def _send_many(n: int, to: str, dask_worker: Any) -> None:
    rt = dask_worker.extensions["dagdiff"]
    for i in range(n):
        rt.transport.send(to, Value("r-order", f"k{i}", 1, pack(np.full(3, i))),
                          lambda e: None)


def _received(run: str, dask_worker: Any) -> tuple[list[str], dict[str, str]]:
    st = dask_worker.extensions["dagdiff"]._runs.get(run)
    if st is None:
        return [], {}
    return list(st.values), dict(st.errors)


def _until(fn: Any, within: float = 20.0) -> Any:
    deadline = time.time() + within
    while True:
        got = fn()
        if got or time.time() > deadline:
            return got
        time.sleep(0.05)


@pytest.mark.distributed
@pytest.mark.parametrize("where", ["tcp", "inproc"])
def test_messages_arrive_in_order(where: str, request: Any) -> None:
    client = request.getfixturevalue("client2" if where == "tcp" else "inproc")
    a0, a1 = _addresses(client)
    client.run(_send_many, 300, a1, workers=[a0])
    got = _until(lambda: len(client.run(_received, "r-order", workers=[a1])[a1][0]) == 300
                 and client.run(_received, "r-order", workers=[a1])[a1][0])
    assert got == [f"k{i}" for i in range(300)]


class _Unpicklable:
    """Pickles fine, fails to unpickle (a class the receiver cannot rebuild)."""

    def __reduce__(self) -> Any:
        return (_refuse, ())


def _refuse() -> Any:
    raise RuntimeError("cannot rebuild this here")


def _send_bad_then_good(to: str, dask_worker: Any) -> None:
    rt = dask_worker.extensions["dagdiff"]
    rt.transport.send(to, Value("r-bad", "bad", 1, pack(_Unpicklable())), lambda e: None)
    rt.transport.send(to, Value("r-bad", "good", 1, pack(np.ones(2))), lambda e: None)


@pytest.mark.distributed
def test_a_value_that_does_not_deserialize_arrives_as_an_error(client2: Any) -> None:
    a0, a1 = _addresses(client2)
    client2.run(_send_bad_then_good, a1, workers=[a0])
    values, errors = _until(lambda: (lambda v: v if v[0] else None)(
        client2.run(_received, "r-bad", workers=[a1])[a1]))
    assert values == ["good"]                        # the stream went on
    assert "the value of bad could not be received on" in errors["bad"]
    assert "cannot rebuild this here" in errors["bad"]


async def _send_to_dead(to: str, dask_worker: Any) -> Any:
    import asyncio

    rt = dask_worker.extensions["dagdiff"]
    got: asyncio.Future = asyncio.get_running_loop().create_future()
    t0 = time.perf_counter()
    rt.transport.send(to, Value("r-dead", "k", 1, pack(1)), got.set_result)
    err = await asyncio.wait_for(got, 60)
    return (None if err is None else type(err).__name__), time.perf_counter() - t0


@pytest.mark.distributed
def test_a_send_to_a_worker_that_is_gone_fails_in_bounded_time(client2: Any) -> None:
    with socket_closed_port() as port:
        pass
    a0, _ = _addresses(client2)
    (err, took), = client2.run(_send_to_dead, f"tcp://127.0.0.1:{port}",
                               workers=[a0]).values()
    assert err is not None                           # reported to the sender
    assert took < 15                                 # the connect deadline (10 s)


async def _send_unserializable_then_good(to: str, dask_worker: Any) -> Any:
    import asyncio
    import threading

    rt = dask_worker.extensions["dagdiff"]
    loop = asyncio.get_running_loop()
    bad: asyncio.Future = loop.create_future()
    good: asyncio.Future = loop.create_future()
    rt.transport.send(to, Value("r-unser", "bad", 1, pack(threading.Lock())), bad.set_result)
    err = await asyncio.wait_for(bad, 30)
    rt.transport.send(to, Value("r-unser", "good", 1, pack(np.ones(2))), good.set_result)
    ok = await asyncio.wait_for(good, 30)
    return type(err).__name__, ok


@pytest.mark.distributed
def test_a_value_that_does_not_serialize_fails_only_its_own_send(client2: Any) -> None:
    """A value pickling refuses fails its sender's message; the comm to that worker stays
    usable (it is not taken for a lost worker)."""
    a0, a1 = _addresses(client2)
    (err, ok), = client2.run(_send_unserializable_then_good, a1, workers=[a0]).values()
    assert err is not None and ok is None
    got = _until(lambda: client2.run(_received, "r-unser", workers=[a1])[a1][0])
    assert got == ["good"]


def _listening_ports(dask_worker: Any) -> tuple[list[int], list[int]]:
    """(ports this worker process listens on, ports Dask's own servers listen on)."""
    import psutil

    mine = sorted({c.laddr.port for c in psutil.Process().net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN})
    own = {int(dask_worker.address.rsplit(":", 1)[1])}
    http = getattr(dask_worker, "http_server", None)
    for sock in getattr(http, "_sockets", {}).values():
        own.add(sock.getsockname()[1])
    return mine, sorted(own)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_pipelines_run_direct_on_a_tls_cluster_and_open_no_port_of_their_own() -> None:
    """security=True (distributed's temporary self-signed credentials): the step runs
    with direct dispatch, its values travel over the cluster's TLS comms, equals jax,
    and the workers listen on Dask's ports only."""
    from distributed import Client

    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True,
                               security=True)
    client = Client(cluster, set_as_default=False)
    try:
        assert all(a.startswith("tls://") for a in client.scheduler_info()["workers"])
        loss_fn = make_loss(2)
        params, x, t = data(2)
        with client.as_current():
            for schedule in ("1f1b", "zb-h1"):
                loss, grads = dd.value_and_grad(loss_fn, microbatches=4, schedule=schedule)(
                    params, x, t)
                funcs = {getattr(v, "func", None) for v in dict(loss.__dask_graph__()).values()}
                assert run_program in funcs
                got_l, got_g = client.compute([loss, grads], sync=True)
                assert_matches_jax(loss_fn, (params, x, t), got_l, got_g)
        for addr, (mine, own) in client.run(_listening_ports).items():
            assert set(mine) <= set(own), (addr, mine, own)
    finally:
        client.close()
        cluster.close()


def test_in_process_workers_use_direct_dispatch(inproc: Any) -> None:
    """processes=False: workers talk inproc://; programs send through the same comms."""
    loss_fn = make_loss(2)
    params, x, t = data(2)
    with inproc.as_current():
        for schedule in ("1f1b", "gpipe"):
            loss, grads = dd.value_and_grad(loss_fn, microbatches=4, schedule=schedule)(
                params, x, t)
            got_l, got_g = inproc.compute([loss, grads], sync=True)
            funcs = {getattr(v, "func", None) for v in dict(loss.__dask_graph__()).values()}
            assert run_program in funcs
            assert_matches_jax(loss_fn, (params, x, t), got_l, got_g)


def _identity(v: Any) -> Any:
    return v


@contextlib.contextmanager
def socket_closed_port() -> Any:
    """A local port nobody listens on."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    yield port


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


def assert_matches_jax(fn: Any, args: tuple[Any, ...], got_l: Any, got_g: Any) -> None:
    """Loss and grads equal `jax.value_and_grad(fn)(*args)`."""
    want_l, want_g = jax.value_and_grad(fn)(*args)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    close(got_g, want_g)


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
    np.testing.assert_array_equal(wire[i]["v"].data, np.full((2, 2), float(i)))
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


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_a_failed_trainer_step_fails_every_stage_and_the_next_step(client2: Any) -> None:
    """Stage 1 fails; stage 0 has finished its own actions, but its new parameters must
    not come out as if the step had worked (the programs' closing exchange), and the
    next step fails too instead of waiting for stage 1."""
    import optax

    def loss_fn(params: Any, x: Any, t: Any) -> Any:
        with dd.stage(0):
            h = _linear(params[0], x)
        with dd.stage(1):
            return _mse(fragile(params[1], h), t)

    params = [jnp.eye(8), jnp.eye(8)]
    ok, bad = jnp.ones((8, 8)), jnp.full((8, 8), 1000.0)
    tr = dd.Trainer(loss_fn, optax.sgd(0.01), microbatches=2, schedule="1f1b",
                    client=client2, dispatch="direct")
    state = tr.init(params, ok, ok)
    state, l1 = tr.step(state, ok, ok)
    state, l2 = tr.step(state, bad, ok)
    failed = state
    state, l3 = tr.step(state, ok, ok)
    assert np.isfinite(l1.result(timeout=60))
    with pytest.raises(Exception, match="fragile: input too large"):
        l2.result(timeout=60)
    assert len(failed.placed) == 2
    for group, fut in failed.placed.items():
        with pytest.raises(Exception, match="fragile: input too large"):
            fut.result(timeout=60)
    with pytest.raises(Exception, match="fragile: input too large"):
        l3.result(timeout=60)
    assert _waiting(client2) == 0
