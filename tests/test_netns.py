"""A direct-dispatch pipeline step with scheduler and workers in their own network namespaces."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import jax
import numpy as np
import pytest

import dagdiff as dd
from tests.conftest import WORKER_ENV
from tests.models import close, data, make_loss

N_WORKERS = 2
PORT = 8786


def _ip_binary() -> str | None:
    return shutil.which("ip") or next(
        (p for p in ("/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip") if os.access(p, os.X_OK)), None)


def _ip(ip: str, *args: str, skip: bool = False) -> None:
    """Run `ip args`; on failure skip the test (creation steps) or fail it (the rest)."""
    r = subprocess.run([ip, *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        msg = f"`ip {' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}"
        if skip:
            pytest.skip(f"cannot build network namespaces here: {msg}")
        pytest.fail(msg)


def _free_net(ip: str) -> str:
    """A 10.213.<k> /24 nobody routes yet, starting from one derived from the pid."""
    for i in range(256):
        net = f"10.213.{(os.getpid() + i) % 256}"
        r = subprocess.run([ip, "-4", "route", "show", "to", "match", f"{net}.1"],
                           capture_output=True, text=True, timeout=30)
        if not [ln for ln in r.stdout.splitlines() if ln and not ln.startswith("default")]:
            return net
    pytest.skip("no free 10.213.x.0/24 subnet")


class Cluster:
    """A scheduler and workers, each in its own network namespace, joined by veth links
    to a bridge in the root namespace (where the client stays); cleaned up by close()."""

    def __init__(self, ip: str, logs: Path) -> None:
        tag = str(os.getpid())
        self.ip, self.logs, self.net = ip, logs, _free_net(ip)
        self.bridge = f"ddb{tag}"
        self.names = ["sched"] + [f"w{i}" for i in range(N_WORKERS)]
        self.ns = {n: f"dd{tag}-{n}" for n in self.names}
        self.addr = {n: f"{self.net}.{2 + i}" for i, n in enumerate(self.names)}
        self.made_ns: list[str] = []
        self.made_links: list[str] = []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.files: list[IO[bytes]] = []

    @property
    def scheduler(self) -> str:
        return f"tcp://{self.addr['sched']}:{PORT}"

    def build(self) -> None:
        ip, tag = self.ip, str(os.getpid())
        _ip(ip, "link", "add", self.bridge, "type", "bridge", skip=True)
        self.made_links.append(self.bridge)
        _ip(ip, "addr", "add", f"{self.net}.1/24", "dev", self.bridge)
        _ip(ip, "link", "set", self.bridge, "up")
        for i, n in enumerate(self.names):
            ns, host, peer = self.ns[n], f"ddv{tag}{i}", f"ddn{tag}{i}"   # <= 15 chars
            _ip(ip, "netns", "add", ns, skip=True)
            self.made_ns.append(ns)
            _ip(ip, "link", "add", host, "type", "veth", "peer", "name", peer, skip=True)
            self.made_links.append(host)
            _ip(ip, "link", "set", peer, "netns", ns, skip=True)
            _ip(ip, "link", "set", host, "master", self.bridge, "up")
            _ip(ip, "-n", ns, "link", "set", "lo", "up")
            _ip(ip, "-n", ns, "addr", "add", f"{self.addr[n]}/24", "dev", peer)
            _ip(ip, "-n", ns, "link", "set", peer, "up")

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        dask = str(Path(sys.executable).parent / "dask")
        log = open(self.logs / f"{name}.log", "wb")
        self.files.append(log)
        self.procs[name] = subprocess.Popen(
            [self.ip, "netns", "exec", self.ns[name], dask, *args], stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
            start_new_session=True)   # its own process group: the nanny and its worker

    def start_all(self) -> None:
        # a leaked process still shuts itself down: the scheduler when idle, workers without it
        self.start("sched", "scheduler", "--host", self.addr["sched"], "--port", str(PORT),
                   "--no-dashboard", "--idle-timeout", "600s")
        env = {**WORKER_ENV, "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False"}
        for i in range(N_WORKERS):
            self.start(f"w{i}", "worker", self.scheduler, "--nthreads", "1", "--resources",
                       f"slot{i}=1", "--preload", "dagdiff", "--host", self.addr[f"w{i}"],
                       "--no-dashboard", "--death-timeout", "60", env=env)

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                pytest.fail(f"{name} exited with {p.returncode}\n{self.tails()}")

    def wait_for_scheduler(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                socket.create_connection((self.addr["sched"], PORT), timeout=1).close()
                return
            except OSError:
                time.sleep(0.5)
        pytest.fail(f"scheduler not reachable at {self.scheduler} in {timeout:.0f} s\n"
                    f"{self.tails()}")

    def wait_for_workers(self, client: Any, timeout: float) -> None:
        """client.wait_for_workers, but failing at once when a worker process exits."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            try:
                client.wait_for_workers(N_WORKERS, timeout=2)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{N_WORKERS} workers did not join in {timeout:.0f} s\n"
                                f"{self.tails()}")

    def tails(self, chars: int = 3000) -> str:
        for f in self.files:
            f.flush()
        out = []
        for name in self.procs:
            text = (self.logs / f"{name}.log").read_text(errors="replace")
            out.append(f"--- {name} ({self.ns[name]}, {self.addr[name]}) ---\n{text[-chars:]}")
        return "\n".join(out)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal(p, signal.SIGKILL)     # the group: also a worker its nanny left behind
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for f in self.files:
            f.close()
        for ns in self.made_ns:
            subprocess.run([self.ip, "netns", "del", ns], capture_output=True, timeout=30)
        for link in self.made_links:      # veths mostly went with their namespace's end
            subprocess.run([self.ip, "link", "del", link], capture_output=True, timeout=30)


def _signal(p: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_direct_pipeline_across_network_namespaces(tmp_path: Path) -> None:
    from distributed import Client

    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    ip = _ip_binary()
    if ip is None:
        pytest.skip("iproute2's `ip` is not installed")
    cluster = Cluster(ip, tmp_path)
    client: Any = None
    try:
        cluster.build()
        cluster.start_all()
        cluster.wait_for_scheduler(timeout=60)
        client = Client(cluster.scheduler, timeout=30, set_as_default=False)
        cluster.wait_for_workers(client, timeout=60)
        workers = client.scheduler_info()["workers"]
        assert all(w.startswith(f"tcp://{cluster.net}.") for w in workers), sorted(workers)

        loss_fn = make_loss(2)
        params, x, t = data(2)
        with client.as_current():
            loss, grads = dd.value_and_grad(loss_fn, microbatches=4, schedule="1f1b",
                                            dispatch="direct")(params, x, t)
            keys = [k if isinstance(k, str) else k[0] for k in loss.__dask_graph__()]
            assert any(k.startswith("prog_") for k in keys), sorted(keys)
            try:
                got_l, got_g = client.compute([loss, grads], sync=True)
            except Exception as e:
                e.add_note(cluster.tails())
                raise
        want_l, want_g = jax.value_and_grad(loss_fn)(params, x, t)
        np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
        close(got_g, want_g)
    finally:
        if client is not None:
            client.close(timeout=10)
        cluster.close()
