"""Direct dispatch, piece by piece on in-process and TCP clusters: inputs that never come,
programs on the wrong worker, dead producers, message order, values that do not (de)serialize,
sends to workers that are gone, TLS."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import numpy as np
import pytest

import dagdiff as dd
from dagdiff.runtime.direct import Consumers, PlannedAction, Program, run_program
from dagdiff.runtime.direct import run as run_mod
from dagdiff.runtime.direct import runtime as rt_mod
from dagdiff.runtime.direct.messages import Value, pack
from tests.models import assert_matches_jax, data, make_loss, probe_every


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
    action = PlannedAction(key, ((src, "slot0"),), 0, (), True,
                           task=Task(key, _identity, TaskRef(src)))
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
    old = client2.run(probe_every, 0.2, workers=[a0])
    try:
        src = "vjp_dense-s1-m0-n1-abc"
        key = "vjp_dense-s0-m0-n0-abc"
        dead = f"tcp://127.0.0.1:{port}"
        action = PlannedAction(key, ((src, "slot1"),), 0, (), True,
                               task=Task(key, _identity, TaskRef(src)))
        prog = Program("prog_slot0-n0-abc", "s-probe", "slot0", a0, (action,), (),
                       timeout=60, members=(("slot1", dead),))
        t0 = time.perf_counter()
        with pytest.raises(dd.DirectDispatchError, match="where nothing listens any more") as e:
            _submit(client2, prog, a0).result(timeout=60)
        assert time.perf_counter() - t0 < 20
        assert f"waits for input {src} from slot1 at {dead}" in str(e.value)
    finally:
        client2.run(probe_every, *old[a0], workers=[a0])


def _fails(x: Any) -> Any:
    raise ValueError("boom")


@pytest.mark.distributed
def test_a_failed_program_does_not_wait_to_tell_unreachable_consumers(client2: Any) -> None:
    """A failed program queues its error notices and returns: 30 actions whose consumer
    cannot be reached cost nothing."""
    from dagdiff.runtime.taskspec import Task

    with socket_closed_port() as port:
        pass
    a0, _ = _addresses(client2)
    dead = f"tcp://127.0.0.1:{port}"
    remote = (Consumers("slot1", 1, address=dead),)
    actions = tuple(PlannedAction(f"fwd_dense-s0-m{i}-n0-abc", (), 0, remote, False,
                                  task=Task(f"fwd_dense-s0-m{i}-n0-abc", _fails, i))
                    for i in range(30))
    prog = Program("prog_slot0-n0-abc", "s-fail-fast", "slot0", a0, actions, (), timeout=60,
                   members=(("slot1", dead),))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="boom"):
        _submit(client2, prog, a0).result(timeout=60)
    assert time.perf_counter() - t0 < 5


def _slow_fail(v: Any) -> Any:
    time.sleep(0.5)                 # the other worker is in the window's next step by now
    raise ValueError("boom in step 1")


def test_a_window_step_failing_after_its_peer_went_on_stops_the_peers_window(
        inproc: Any) -> None:
    """Windows of 3 steps on two workers: slot0 sends slot1 a value each step; in step
    1, after sending it, slot0 fails (slowly). slot1 has finished step 1 by then without
    waiting for slot0 (a window's steps before its last make no closing exchange) and
    waits in step 2 for a value that never comes: it stops at once with slot0's error,
    not after its 60 s timeout. Step 0 and a window without failures run through."""
    from dagdiff.runtime.direct.runtime import run_programs
    from dagdiff.runtime.taskspec import Task, TaskRef

    a0, a1 = _addresses(inproc)
    members0, members1 = (("slot1", a1),), (("slot0", a0),)

    def window(fail_at: int | None, tag: str) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        rest0: list[Any] = []
        rest1: list[Any] = []
        for i in range(3):
            x = f"fwd_dense-s0-m0-n0-{tag}{i}"
            y = f"fwd_dense-s1-m0-n1-{tag}{i}"
            acts0 = [PlannedAction(x, (), 0, (Consumers("slot1", 1, address=a1),), False,
                                   task=Task(x, _identity, i))]
            if i == fail_at:
                z = f"vjp_dense-s0-m0-n0-{tag}{i}"
                acts0.append(PlannedAction(z, (), 0, (), False, task=Task(z, _slow_fail, i)))
            acts1 = [PlannedAction(y, ((x, "slot0"),), 0, (), True,
                                   task=Task(y, _identity, TaskRef(x)))]
            rest0 += [Program("prog_slot0-n0-w", f"s-{tag}{i}", "slot0", a0, tuple(acts0), (),
                              timeout=60, members=members0), f"{tag}-0-{i}", 0]
            rest1 += [Program("prog_slot1-n1-w", f"s-{tag}{i}", "slot1", a1, tuple(acts1), (),
                              timeout=60, members=members1), f"{tag}-1-{i}", 0]
        return tuple(rest0), tuple(rest1)

    def submit(task: str, where: str, rest: tuple[Any, ...], nonce: str,
               keep: tuple[str, ...] = ()) -> Any:
        return inproc.submit(run_programs, task, 3, nonce, *rest, keep=keep, key=task,
                             workers=[where], allow_other_workers=False, pure=False)

    rest0, rest1 = window(None, "ok")
    keep = tuple(f"{i}:fwd_dense-s1-m0-n1-ok{i}" for i in range(3))
    ok = [submit("win0-ok", a0, rest0, "nok"), submit("win1-ok", a1, rest1, "nok", keep)]
    assert dict(ok[1].result(timeout=30)) == {k: i for i, k in enumerate(keep)}
    ok[0].result(timeout=30)
    rest0, rest1 = window(1, "bad")
    bad = [submit("win0-bad", a0, rest0, "nbad"), submit("win1-bad", a1, rest1, "nbad")]
    with pytest.raises(ValueError, match="boom in step 1"):
        bad[0].result(timeout=30)
    with pytest.raises(ValueError, match="boom in step 1") as e:
        bad[1].result(timeout=30)                   # within 30 s: not its 60 s timeout
    assert not isinstance(e.value, dd.UpstreamError)    # slot0's own exception, again


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
        stream_handlers: dict[str, Any] = {}
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


def _send_many(n: int, to: str, lanes: bool, run: str, dask_worker: Any) -> None:
    import dask

    rt = dask_worker.extensions["dagdiff"]
    with dask.config.set({"dagdiff.direct.lanes": lanes}):
        for i in range(n):
            rt.transport.send(to, Value(run, f"k{i}", 1, pack(np.full(3, i))),
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
@pytest.mark.parametrize("where", ["tcp", "tcp-comm", "inproc"])
def test_messages_arrive_in_order(where: str, request: Any) -> None:
    """On a lane (tcp), on the comm itself (config ``dagdiff.direct.lanes: false``) and
    in-process: 300 messages queued at once arrive in their order."""
    client = request.getfixturevalue("inproc" if where == "inproc" else "client2")
    a0, a1 = _addresses(client)
    run = f"r-order-{where}"
    try:
        client.run(_send_many, 300, a1, where == "tcp", run, workers=[a0])
        got = _until(lambda: len(client.run(_received, run, workers=[a1])[a1][0]) == 300
                     and client.run(_received, run, workers=[a1])[a1][0])
    finally:
        client.run(_forget_run, run, workers=[a1])
    assert got == [f"k{i}" for i in range(300)]


async def _send_from_a_program_thread(to: str, run: str, dask_worker: Any) -> list[str]:
    """Send small and large values alternately from a thread that runs no event loop (as
    a program does): small ones are written by this thread, large ones by the lane's
    writer thread; returns the errors `done` was told of. The worker's event loop stays
    free meanwhile (it connects the lane)."""
    import asyncio

    rt = dask_worker.extensions["dagdiff"]
    errors: list[str] = []
    done = threading.Event()
    left = [120]
    lock = threading.Lock()

    def told(err: BaseException | None) -> None:
        with lock:
            if err is not None:
                errors.append(repr(err))
            left[0] -= 1
            if left[0] == 0:
                done.set()

    def body() -> None:
        for i in range(120):
            n = 3 if i % 3 else 50_000               # 400 KB: over lanes.INLINE_WRITE
            rt.transport.send(to, Value(run, f"k{i}", 1, pack(np.full(n, float(i)))), told)

    def send_all() -> bool:
        t = threading.Thread(target=body)
        t.start()
        t.join()
        return done.wait(60)

    assert await asyncio.get_running_loop().run_in_executor(None, send_all), \
        "not every send was told of its outcome"
    return errors


def _received_values(run: str, dask_worker: Any) -> list[tuple[str, float, int]]:
    st = dask_worker.extensions["dagdiff"]._runs.get(run)
    if st is None:
        return []
    return [(k, float(v[0][0]), v[0].size) for k, v in st.values.items()]


def _lane_threads(dask_worker: Any) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("dagdiff-lane"))


@pytest.mark.distributed
def test_a_programs_small_and_large_values_keep_their_order_on_a_lane(client2: Any) -> None:
    """A program thread writes a small value itself and leaves a large one to the lane's
    writer thread: the receiver still gets them in the order they were sent, whole."""
    a0, a1 = _addresses(client2)
    run = "r-mixed"
    try:
        errors = client2.run(_send_from_a_program_thread, a1, run, workers=[a0])[a0]
        got = _until(lambda: (lambda g: g if len(g) == 120 else None)(
            client2.run(_received_values, run, workers=[a1])[a1]))
    finally:
        client2.run(_forget_run, run, workers=[a1])
    assert errors == []
    assert [k for k, _, _ in got] == [f"k{i}" for i in range(120)]
    assert all(v == float(i) and n == (3 if i % 3 else 50_000)
               for i, (_, v, n) in enumerate(got))
    assert any(n.startswith("dagdiff-lane-to-") for n in client2.run(_lane_threads)[a0])
    assert any(n.startswith("dagdiff-lane-from-") for n in client2.run(_lane_threads)[a1])


def _send_values(to: str, dask_worker: Any) -> None:
    import jax.numpy as jnp
    import ml_dtypes

    from dagdiff.runtime.tasks import FwdResult

    rt = dask_worker.extensions["dagdiff"]
    values = _wire_values(jnp, ml_dtypes, FwdResult)
    for k, v in values.items():
        rt.transport.send(to, Value("r-wire", k, 1, pack(v)), lambda e: None)


def _wire_values(jnp: Any, ml_dtypes: Any, FwdResult: Any) -> dict[str, Any]:
    small = np.arange(12, dtype=np.float32).reshape(3, 4)
    return {
        "small": small,                                   # inline (<= INLINE_BYTES)
        "jax": jnp.asarray(small) * 2,                     # a CPU jax array, inline
        "big": np.arange(40_000, dtype=np.float64),        # over the limit: Dask's way
        "scalar": np.array(3.5, dtype=np.float32),             # 0-d
        "ints": np.array([[1, -2], [3, 4]], dtype=np.int64),
        "bools": np.array([True, False, True]),
        "bf16": np.ones((2, 2), dtype=ml_dtypes.bfloat16),  # no NumPy dtype string: Dask's
        "strided": small[:, ::2],                          # a non-contiguous view
        "tuple": (small, None, np.ones(3, np.float16)),
        "fwd": FwdResult([small, np.ones(5, np.float32)], None),
        "masked": np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False]),
        "big-endian": np.arange(5, dtype=">f4"),
        "user-dict": {"t": "nd", "nd": 1, "x": np.ones(2)},   # not mistaken for an array
    }


def _got_values(dask_worker: Any) -> Any:
    st = dask_worker.extensions["dagdiff"]._state("r-wire")
    return {k: v[0] for k, v in st.values.items()}, dict(st.errors)


def _send_float8(to: str, dask_worker: Any) -> None:
    import ml_dtypes

    rt = dask_worker.extensions["dagdiff"]
    rt.transport.send(to, Value("r-wire", "f8", 1,
                                pack(np.ones(4, dtype=ml_dtypes.float8_e5m2))), lambda e: None)


def _forget_run(run: str, dask_worker: Any) -> None:
    """Drop a run that no program will take (its values would otherwise be held, and
    counted by memory measurements on this shared cluster, for `STALE_AFTER`)."""
    dask_worker.extensions["dagdiff"]._finish(run, "ended")


@pytest.mark.distributed
def test_values_cross_the_wire_unchanged(client2: Any) -> None:
    """Small host arrays travel inline in the message, large ones and dtypes NumPy cannot
    name through Dask's serializers: each arrives with its dtype, shape and values, as a
    writeable array of its own (a masked array with its mask, a user's dict as a dict).
    A value that cannot be rebuilt on the receiver arrives as an error naming it (its
    consumer fails at once) rather than never."""
    import jax.numpy as jnp
    import ml_dtypes

    from dagdiff.runtime.tasks import FwdResult

    from dagdiff.runtime.direct.messages import INLINE_BYTES

    assert pack(np.ones(INLINE_BYTES // 8))["t"] == "nd"               # inline
    assert pack(np.ones(INLINE_BYTES // 8 + 1))["t"] == "v"            # Dask's serializers
    a0, a1 = _addresses(client2)
    want = _wire_values(jnp, ml_dtypes, FwdResult)
    client2.run(_send_values, a1, workers=[a0])
    client2.run(_send_float8, a1, workers=[a0])
    try:
        got, errors = _until(lambda: (lambda g: g if len(g[0]) + len(g[1]) > len(want) else
                                      None)(client2.run(_got_values, workers=[a1])[a1]))
    finally:
        client2.run(_forget_run, "r-wire", workers=[a1])
    assert set(got) == set(want) and set(errors) == {"f8"}, (sorted(got), errors)
    assert "f8" in errors["f8"]

    def same(u: Any, v: Any) -> None:
        u = np.asarray(u)
        v = np.asarray(v)
        assert u.dtype == v.dtype and u.shape == v.shape, (u.dtype, u.shape, v.dtype, v.shape)
        np.testing.assert_array_equal(u.astype(np.float64), v.astype(np.float64))

    for k in ("small", "jax", "big", "scalar", "ints", "bools", "bf16", "strided",
              "big-endian"):
        same(got[k], want[k])
        assert isinstance(got[k], np.ndarray) and got[k].flags.writeable, k
    assert isinstance(got["masked"], np.ma.MaskedArray)
    assert got["masked"].mask.tolist() == [False, True, False]
    assert got["user-dict"]["t"] == "nd" and got["user-dict"]["nd"] == 1
    np.testing.assert_array_equal(got["user-dict"]["x"], np.ones(2))
    same(got["tuple"][0], want["tuple"][0])
    assert got["tuple"][1] is None
    same(got["tuple"][2], want["tuple"][2])
    for u, v in zip(got["fwd"].out, want["fwd"].out):
        same(u, v)


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


def _on_loop(fut: Any) -> Any:
    """A send's `done` that sets `fut` on its event loop (`done` runs in whichever thread
    wrote the message)."""
    loop = fut.get_loop()
    return lambda err: loop.call_soon_threadsafe(fut.set_result, err)


async def _send_to_dead(to: str, dask_worker: Any) -> Any:
    import asyncio

    rt = dask_worker.extensions["dagdiff"]
    got: asyncio.Future = asyncio.get_running_loop().create_future()
    t0 = time.perf_counter()
    rt.transport.send(to, Value("r-dead", "k", 1, pack(1)), _on_loop(got))
    err = await asyncio.wait_for(got, 60)
    return (None if err is None else type(err).__name__), time.perf_counter() - t0


@pytest.mark.slow
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
    rt.transport.send(to, Value("r-unser", "bad", 1, pack(threading.Lock())), _on_loop(bad))
    err = await asyncio.wait_for(bad, 30)
    rt.transport.send(to, Value("r-unser", "good", 1, pack(np.ones(2))), _on_loop(good))
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
        for addr, names in client.run(_lane_threads).items():    # values went on lanes
            assert any(n.startswith("dagdiff-lane-from-tls://") for n in names), (addr, names)
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


# --- a step's state taken in place from the step before (LocalImport) -------------------

class _FakeWorker:
    def __init__(self) -> None:
        self.handlers: dict[str, Any] = {}
        self.stream_handlers: dict[str, Any] = {}
        self.extensions: dict[str, Any] = {}
        self.data: dict[str, Any] = {}
        self.address = "tcp://fake:1"


def test_an_import_comes_from_the_run_that_made_it_else_from_memory_else_fails() -> None:
    """`take_import`: the exports of the named run once it ended here; that run's error
    (with its message) when it failed; the worker's memory for a run not kept here (the
    other submission of a step submitted twice); a cancelled step or the step's timeout
    stop the wait with the key named."""
    import threading
    from types import SimpleNamespace

    from dagdiff.errors import DirectDispatchError
    from dagdiff.runtime.direct.results import LocalImport

    rt = rt_mod.DirectRuntime(_FakeWorker())
    prog = SimpleNamespace(key="prog_slot0-n0-b", where="slot0", timeout=0.3)
    st = SimpleNamespace(abort=None)
    rt.keep_exports("s1", {"update_g0-a": 41})
    rt.keep_exports("s2", rt_mod.Failed("ValueError: fragile: input too large"))
    assert rt.take_import(prog, st, LocalImport("update_g0-A", "s1", "update_g0-a")) == 41
    with pytest.raises(DirectDispatchError, match="fragile: input too large"):
        rt.take_import(prog, st, LocalImport("update_g0-B", "s2", "update_g0-a"))
    # an exception that travels: the failed run's own, again, with a note saying where
    cause = run_mod.cause_of(ValueError("fragile: input too large"))
    rt.keep_exports("s2b", rt_mod.Failed("ValueError: fragile: input too large", cause))
    with pytest.raises(ValueError, match="fragile: input too large") as e:
        rt.take_import(prog, st, LocalImport("update_g0-B2", "s2b", "update_g0-a"))
    assert type(e.value) is ValueError
    assert "the step before" in "".join(e.value.__notes__)
    rt.worker.data["update_g0-C"] = 42                 # picked by its own output task
    assert rt.take_import(prog, st, LocalImport("update_g0-C", "s3", "update_g0-a")) == 42

    def later() -> None:                               # the run ends while the step waits
        time.sleep(0.1)
        rt.keep_exports("s4", {"update_g0-a": 43})

    threading.Thread(target=later).start()
    t0 = time.monotonic()
    assert rt.take_import(prog, st, LocalImport("update_g0-D", "s4", "update_g0-a")) == 43
    assert time.monotonic() - t0 < 0.25
    with pytest.raises(DirectDispatchError, match="update_g0-E.*never ran here"):
        rt.take_import(prog, st, LocalImport("update_g0-E", "s5", "update_g0-a"))
    st.abort = "the step was cancelled"
    with pytest.raises(DirectDispatchError, match="cancelled"):
        rt.take_import(prog, st, LocalImport("update_g0-E", "s5", "update_g0-a"))
    for i in range(rt_mod.EXPORTS_KEPT):               # the newest runs only
        rt.keep_exports(f"x{i}", {"update_g0-a": i})
    assert len(rt._exports) == rt_mod.EXPORTS_KEPT and "s1" not in rt._exports
    rt.worker.data.clear()
    with pytest.raises(DirectDispatchError, match="never ran here"):
        rt.take_import(prog, SimpleNamespace(abort=None),
                       LocalImport("update_g0-A", "s1", "update_g0-a"))


def test_a_program_task_released_before_its_program_began_stops_as_it_begins() -> None:
    """The scheduler released a program task whose thread had not reached its program yet
    (or a window's task between two of its programs): `cancel` finds nothing running and
    marks the task's Dask run; its program then stops as it begins (with `Reschedule`:
    Dask drops a released task's outcome, and one submitted again meanwhile runs again),
    and a later run of the same key (a new Dask run id) is not stopped by the old mark."""
    from types import SimpleNamespace

    from distributed import Reschedule

    worker = _FakeWorker()
    worker.state = SimpleNamespace(tasks={"prog_slot0-n0-c": SimpleNamespace(run_id=7)})
    rt = rt_mod.DirectRuntime(worker)
    prog = Program("prog_slot0-n0-c", "c", "slot0", worker.address, (), (), 5.0)
    rt.cancel("prog_slot0-n0-c")                       # released: nothing runs yet
    with pytest.raises(Reschedule, match="cancelled before this program began"):
        rt._run(prog, "n1", (), secede=False)
    assert rt._running == {}
    worker.state.tasks["prog_slot0-n0-c"].run_id = 8   # computed again later
    rt.cancel("prog_slot0-n0-x")                       # another task's mark
    assert rt._run(prog, "n2", (), secede=False) == {}  # no actions: it just runs
    assert rt._running == {}


def test_a_program_thread_resumed_for_a_new_submission_runs_again_under_its_id() -> None:
    """A program task released while its thread runs (Ctrl-C) and submitted again before
    the thread ended is resumed by distributed's worker: the thread goes on with the old
    run id while the step's other programs run under the new one, which only the task's
    ``run_spec`` holds. The thread then raises ``Reschedule`` (the scheduler runs the task
    again under the new id; `ColocateVJP` keeps it), whether it notices before its
    program begins or through the cancellation while it runs; before, it ran under the
    old id or failed the new step with the old run's cancellation, and the step's other
    programs waited for it until `dagdiff.direct.timeout`."""
    from types import SimpleNamespace

    from dask._task_spec import Task
    from distributed import Reschedule

    def spec(nonce: str) -> Any:
        return Task("prog_slot0-n0-r", rt_mod.run_program, "prog", rt_mod.RunNonce(nonce))

    worker = _FakeWorker()
    ts = SimpleNamespace(run_id=3, run_spec=spec("old"))
    worker.state = SimpleNamespace(tasks={"prog_slot0-n0-r": ts})
    rt = rt_mod.DirectRuntime(worker)
    prog = Program("prog_slot0-n0-r", "r", "slot0", worker.address, (), (), 5.0)
    assert not rt.resumed(prog.key, rt_mod.RunNonce("old"))
    assert rt._run(prog, rt_mod.RunNonce("old"), (), secede=False) == {}
    ts.run_spec, ts.run_id = spec("new"), 4             # resumed for a new submission
    assert rt.resumed(prog.key, rt_mod.RunNonce("old"))
    with pytest.raises(Reschedule):
        rt._run(prog, rt_mod.RunNonce("old"), (), secede=False)
    assert rt._running == {}
    assert rt._run(prog, rt_mod.RunNonce("new"), (), secede=False) == {}


async def _lose_and_send_again(to: str, run: str, dask_worker: Any) -> tuple[bool, bool, Any]:
    import asyncio

    rt = dask_worker.extensions["dagdiff"]
    loop = asyncio.get_running_loop()
    first: asyncio.Future = loop.create_future()
    rt.transport.send(to, Value(run, "before", 1, pack(np.ones(2))), _on_loop(first))
    assert await asyncio.wait_for(first, 30) is None
    had = to in rt.transport._lanes
    await rt._peer_lost(to)                     # as the scheduler's plugin calls it
    gone = to not in rt.transport._lanes
    again: asyncio.Future = loop.create_future()
    rt.transport.send(to, Value(run, "after", 1, pack(np.ones(2))), _on_loop(again))
    return had, gone, await asyncio.wait_for(again, 30)


@pytest.mark.distributed
def test_a_lost_workers_lane_is_closed_and_a_later_send_opens_a_new_one(client2: Any) -> None:
    """When the scheduler reports a worker removed, the lane to it is closed (no socket
    and thread kept for a worker that left); a worker at that address later gets a new
    lane, and its messages arrive."""
    a0, a1 = _addresses(client2)
    run = "r-lost"
    try:
        had, gone, err = client2.run(_lose_and_send_again, a1, run, workers=[a0])[a0]
        got = _until(lambda: (lambda v: v if len(v[0]) == 2 else None)(
            client2.run(_received, run, workers=[a1])[a1]))
    finally:
        client2.run(_forget_run, run, workers=[a1])
        client2.run(_forget_lost, a1, workers=[a0])
    assert (had, gone, err) == (True, True, None)
    assert got[0] == ["before", "after"]


def _forget_lost(address: str, dask_worker: Any) -> None:
    """Undo `_peer_lost`'s record (this shared cluster's worker is still there)."""
    dask_worker.extensions["dagdiff"].lost.pop(address, None)


def test_a_lane_connect_given_up_on_is_cancelled(monkeypatch: Any) -> None:
    """A writer thread that gives up waiting for its event loop to connect a lane cancels
    the connect (else the comm it opened later would be left to the GC, still open)."""
    import asyncio

    from dagdiff.runtime.direct import transport as tr_mod

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    seen: list[str] = []

    async def slow_open(worker: Any, address: str, timeout: float, op: str) -> Any:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        seen.append("opened")
        return object(), None, {}

    class Loop:
        asyncio_loop = loop

    class Worker:
        handlers: dict[str, Any] = {}
        stream_handlers: dict[str, Any] = {}
        address = "tcp://127.0.0.1:1"

    w = Worker()
    w.loop = Loop()                                   # type: ignore[attr-defined]
    monkeypatch.setattr(tr_mod, "open_lane", slow_open)
    monkeypatch.setattr(tr_mod, "CONNECT_TIMEOUT", -4.8)   # gives up after 0.2 s
    t = tr_mod.Transport(w, lambda msg: None)
    try:
        with pytest.raises(TimeoutError):
            t._open_lane("tcp://127.0.0.1:2")
        assert _until(lambda: seen, within=5) == ["cancelled"]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_removed_worker_is_told_on_each_workers_stream_without_an_error_log(
        caplog: Any) -> None:
    """dagdiff's scheduler plugin tells every other worker that a worker left on the
    scheduler's batched stream to it (no connection per worker); a stream that is closing
    (the whole cluster shutting down) is skipped quietly: distributed's ``broadcast`` had
    logged an ERROR for each worker that closed meanwhile."""
    import logging
    from types import SimpleNamespace

    from distributed.comm.core import CommClosedError

    from dagdiff.runtime.plugins import ColocateVJP

    class Stream:
        def __init__(self, closed: bool) -> None:
            self.closed, self.sent = closed, []

        def send(self, *msgs: Any) -> None:
            if self.closed:
                raise CommClosedError("closing")
            self.sent.extend(msgs)

    streams = {"tcp://a:1": Stream(False), "tcp://b:1": Stream(True),
               "tcp://gone:1": Stream(False)}
    events: list[Any] = []
    plugin = ColocateVJP()
    plugin.scheduler = SimpleNamespace(stream_comms=streams,
                                       log_event=lambda *a: events.append(a))
    with caplog.at_level(logging.DEBUG):
        plugin.remove_worker(plugin.scheduler, "tcp://gone:1")
    assert streams["tcp://a:1"].sent == [{"op": "dagdiff_peer_lost",
                                          "address": "tcp://gone:1"}]
    assert streams["tcp://gone:1"].sent == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert events and events[0][1] == {"action": "remove", "worker": "tcp://gone:1"}


def _lost_here(address: str, dask_worker: Any) -> bool:
    return address in dask_worker.extensions["dagdiff"].lost


@pytest.mark.distributed
def test_every_worker_hears_of_a_removed_worker_from_the_scheduler(client2: Any) -> None:
    """The scheduler plugin's notice reaches each worker's runtime through its stream
    handler (a program waiting on the removed worker stops at once)."""
    gone = "tcp://10.0.0.9:4242"                       # no such worker: nothing else moves
    try:
        client2.run_on_scheduler(_remove_on_scheduler, gone)
        assert _until(lambda: all(client2.run(_lost_here, gone).values()) or None)
    finally:
        for a in _addresses(client2):
            client2.run(_forget_lost, gone, workers=[a])


def _remove_on_scheduler(address: str, dask_scheduler: Any) -> None:
    """Call dagdiff's scheduler plugin as the scheduler does when a worker leaves."""
    dask_scheduler.plugins["dagdiff-colocate-vjp"].remove_worker(dask_scheduler, address)


class _LockedError(ValueError):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()            # pickle refuses it


def test_a_failure_elsewhere_is_raised_as_the_failing_programs_own_exception() -> None:
    """What a program raises when another program of its step failed: a copy of that
    program's exception (its type, message and notes: a layer's ValueError is a
    ValueError on every worker, whichever Dask reports), passed on again by the programs
    it fails in turn; an `UpstreamError` with the text where the exception cannot travel
    (it does not pickle, or it is dagdiff's own dispatch error)."""
    from dagdiff.errors import DirectDispatchError
    from dagdiff.runtime.direct.messages import End, Failure

    boom = ValueError("boom in layer dense")
    boom.add_note("in the forward of layer 'dense' (stage 1, microbatch 0)")
    cause = run_mod.cause_of(boom)
    assert cause is not None
    assert run_mod.cause_of(_LockedError("no")) is None
    assert run_mod.cause_of(DirectDispatchError("lost")) is None
    assert run_mod.cause_of(ValueError("x" * (run_mod.CAUSE_BYTES + 10))) is None

    st = run_mod.ProgramRun("r1", 1.0, lambda *a: None, lambda *a: ("running", ""))
    st.deliver(Failure("r1", "fwd_dense-s1-m0", "fwd_dense failed on slot1: boom", cause))
    again = st.upstream(st.errors["fwd_dense-s1-m0"])
    assert type(again) is ValueError and str(again) == "boom in layer dense"
    assert again.__notes__ == boom.__notes__
    assert run_mod.cause_of(again) == cause             # passed on as it came
    assert run_mod._describe(again, "elsewhere") == "boom in layer dense"
    st.deliver(End("r1", "slot2", "the step failed on slot2: it broke", None))
    plain = st.upstream(st.ends["slot2"])
    assert isinstance(plain, dd.UpstreamError) and "it broke" in str(plain)
