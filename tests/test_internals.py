"""The guard of `dagdiff.runtime.internals`: every private part of distributed it relies on
still exists in the installed release, checked by name (a failure names the one that
changed, and `internals.py` is the one place to mend)."""
from __future__ import annotations

import ast
import importlib
import os
from typing import Any

import pytest

from dagdiff.runtime import internals

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "dagdiff")


def _resolve(where: str) -> Any:
    module, _, attr = where.rpartition(".")
    try:
        return importlib.import_module(where)
    except ImportError:
        return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("where,name", [r for r in internals.REQUIRED
                                        if " instance" not in r[0]])
def test_a_class_or_module_attribute_is_there(where: str, name: str) -> None:
    obj = _resolve(where)
    assert hasattr(obj, name), (
        f"distributed changed: {where}.{name} is gone (used by dagdiff.runtime.internals); "
        "mend internals.py")


def test_the_instance_attributes_are_there_on_a_running_cluster() -> None:
    from distributed import Client, LocalCluster, get_worker

    with LocalCluster(n_workers=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        scheduler = cluster.scheduler
        assert isinstance(internals.stream_comms(scheduler), dict) and \
            internals.stream_comms(scheduler), "Scheduler.stream_comms"
        stream = next(iter(internals.stream_comms(scheduler).values()))
        assert isinstance(stream.interval, float), "BatchedSend.interval"
        assert isinstance(internals.client_stream(client).interval, float), \
            "Client.scheduler_comm.interval"
        client_comm = internals.scheduler_client_stream(scheduler, client.id)
        assert isinstance(client_comm.interval, float), "Scheduler.client_comms[id].interval"
        assert internals.amm_policies(scheduler) is not None, "extensions['amm'].policies"
        assert hasattr(internals.amm_policies(scheduler), "discard"), "policies.discard"
        client.get_task_stream()                    # registers the task-stream plugin
        plugin = scheduler.plugins.get(internals.TASK_STREAM)
        assert plugin is not None and callable(plugin.transition), \
            "plugins['task-stream'].transition"
        assert internals.task_stream_record(scheduler, "k-1", 1.0, 2.0, "w")
        assert plugin.buffer[-1]["key"] == "k-1", "the task stream's record format"

        import collections

        assert isinstance(stream.recent_message_log, collections.deque), \
            "BatchedSend.recent_message_log"
        internals.bound_message_log(stream, 3)
        assert stream.recent_message_log.maxlen == 3, "BatchedSend.recent_message_log"
        assert callable(scheduler._broker.truncate), "Scheduler._broker.truncate"
        scheduler.log_event("dagdiff-guard", {"x": 1})
        internals.forget_topic_events(scheduler, "dagdiff-guard")
        assert not scheduler._broker._topics["dagdiff-guard"].events, "Broker.truncate"

        def worker_side() -> tuple[bool, bool, bool]:
            w = get_worker()
            task = next(t for k, t in w.state.tasks.items() if t.state == "executing")
            links = all(isinstance(getattr(task, a), set)
                        for a in ("dependencies", "dependents", "waiters"))
            own = internals.worker_task(w, task.key)
            spec = (own is task and getattr(own.run_spec, "key", None) == task.key
                    and isinstance(own.run_id, int))
            return (isinstance(w.batched_stream.interval, float),
                    isinstance(internals.scheduler_delay(w), float), links, spec)

        assert client.submit(worker_side).result() == (True, True, True, True), \
            "Worker.batched_stream.interval / Worker.scheduler_delay / TaskState links / " \
            "TaskState.run_spec and run_id (worker_task)"


def test_a_comm_takes_the_deserialize_switch() -> None:
    import inspect

    from distributed.comm.core import Comm

    assert "self.deserialize" in inspect.getsource(Comm.__init__), "Comm.deserialize"


def test_a_reschedule_has_its_own_stimulus_id() -> None:
    """`internals.rescheduled`: a task raising ``Reschedule`` sends the scheduler a
    stimulus id that starts with ``RESCHEDULE_STIMULUS``."""
    import inspect

    from distributed.worker import Worker

    assert f'stimulus_id=f"{internals.RESCHEDULE_STIMULUS}' in inspect.getsource(
        Worker.execute), "Worker.execute's RescheduleEvent stimulus id"
    assert internals.rescheduled("reschedule-1.5") and not internals.rescheduled(
        "client-releases-keys-1.5") and not internals.rescheduled(None)


def test_a_comm_takes_the_offload_switch() -> None:
    """`internals.inline_writes`: a TCP comm's writes read `allow_offload`."""
    import inspect

    from distributed.comm.core import Comm
    from distributed.comm.tcp import TCP

    assert "self.allow_offload" in inspect.getsource(Comm.__init__), "Comm.allow_offload"
    assert "allow_offload=self.allow_offload" in inspect.getsource(TCP.write), "TCP.write"


PRIVATE = ("_update_worker_status", "_correct_state", "worker_restrictions",
           "loose_restrictions", "stream_comms", "batched_stream", "scheduler_delay",
           "merge_and_deserialize", "serialize_numpy_ndarray", "dont_reply", "allow_offload",
           "_read_buffer_size", "remove_handler")


def test_no_other_module_reaches_into_distributed_internals() -> None:
    """Only internals.py names distributed's private parts (and local.py overrides the
    status hook, whose body goes through internals)."""
    found = []
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if not f.endswith(".py") or f == "internals.py":
                continue
            path = os.path.join(root, f)
            tree = ast.parse(open(path).read())
            where = os.path.relpath(path, PACKAGE)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and "internals" not in (node.module or ""):
                    found += [f"{where}:{node.lineno}: import {a.name}" for a in node.names
                              if a.name in PRIVATE]
                elif isinstance(node, ast.Attribute) and node.attr in PRIVATE:
                    found.append(f"{where}:{node.lineno}: .{node.attr}")
                elif (isinstance(node, ast.Constant) and node.value in PRIVATE
                      and isinstance(node.value, str)):
                    found.append(f"{where}:{node.lineno}: {node.value!r}")
    assert not found, "distributed internals outside dagdiff/runtime/internals.py: " + \
        "; ".join(found)


@pytest.mark.parametrize("tls", [False, True])
def test_a_tcp_or_tls_comms_socket_can_be_taken_from_the_event_loop(tls: bool) -> None:
    """`internals.take_socket` (direct dispatch's lanes): after a message on the comm,
    both ends' sockets are handed to the caller in blocking mode and carry raw bytes both
    ways; an inproc comm has none to hand over."""
    import asyncio

    from distributed.comm import connect, listen
    from distributed.security import Security

    sec = Security.temporary() if tls else Security()
    scheme = "tls" if tls else "tcp"

    async def main() -> tuple[bytes, bytes, bool]:
        taken: asyncio.Future = asyncio.get_running_loop().create_future()

        async def handle(comm: Any) -> None:
            await comm.read()
            taken.set_result((comm, await internals.take_socket(comm)))

        listener = listen(f"{scheme}://127.0.0.1:0", handle,
                          **sec.get_listen_args("scheduler"))
        await listener.start()
        comm = await connect(listener.contact_address, **sec.get_connection_args("worker"))
        await comm.write({"op": "hello"})
        mine = await internals.take_socket(comm)
        theirs_comm, theirs = await asyncio.wait_for(taken, 10)
        assert mine is not None and theirs is not None
        assert mine.getblocking() and theirs.getblocking()

        def exchange() -> tuple[bytes, bytes]:
            mine.sendall(b"ping")
            got = theirs.recv(4)
            theirs.sendall(b"pong")
            return got, mine.recv(4)

        got = await asyncio.get_running_loop().run_in_executor(None, exchange)
        comm.abort()
        theirs_comm.abort()
        listener.stop()

        inproc = listen("inproc://", lambda c: None)
        await inproc.start()
        c2 = await connect(inproc.contact_address)
        none = await internals.take_socket(c2) is None
        c2.abort()
        inproc.stop()
        return got[0], got[1], none

    assert asyncio.run(main()) == (b"ping", b"pong", True)


def test_the_readmes_configuration_table_names_every_dagdiff_config_key() -> None:
    """Every ``dagdiff.*`` Dask config key the package reads is in the README's
    configuration table, and the table names no key the package does not read."""
    import re

    used: set[str] = set()
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                used |= set(re.findall(r"\"(dagdiff\.[a-z0-9.-]+)\"",
                                       open(os.path.join(root, f)).read()))
    readme = open(os.path.join(PACKAGE, "..", "README.md")).read()
    section = readme.split("### Configuration", 1)[1].split("\n\n", 2)[1]
    listed = set(re.findall(r"^\| `(dagdiff\.[a-z0-9.-]+)` \|", section, re.M))
    assert used and listed == used, (sorted(used - listed), sorted(listed - used))
