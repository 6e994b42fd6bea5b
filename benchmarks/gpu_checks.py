"""The README's GPU checks as one prepared run, for a session lent a CUDA machine.

Sections, each in a process of its own with a time limit, most important first:
  env        nvidia-smi, JAX's devices, CuPy, versions;
  cupy       the CuPy kernels against their NumPy references (`tests/test_kernels_math.py
             -k cuda`);
  cluster    `dd.local_cluster(2)` on the GPU machine: each worker's JAX devices and
             environment; a 1F1B `value_and_grad` step of the tiny MLP against
             `jax.value_and_grad` (max error); a GPU jax array sent from one worker's
             program to the other's (dagdiff's transport): does it arrive as a jax array on
             the GPU; a zero-time `Trainer.step` and `fit` (fixed cost, `bench_fixed_cost`'s
             job);
  tiny       `bench_peers.py` tiny job, jax.jit against dagdiff (`value_and_grad`,
             `step.compute`, `fit`), one round;
  kernels    `bench_kernels.py`: CuPy kernels against NumPy and `jax.jit`.
Prints each section's output and a summary; writes ``gpu_checks.json`` and
``gpu_checks.log`` to ``$OUT`` (the device tool's folder) or ``--out``. Runs on a machine
without a GPU too (GPU-only checks say so), which is how it is tested.

The device machines hold JAX, CuPy, optax and torch but not Dask: fetch its wheels here
first (PyPI is reachable here, not there), then carry them:
  python benchmarks/gpu_checks.py --fetch-wheels .wheels      # here; .wheels is git-ignored
  device run: python3 benchmarks/gpu_checks.py --wheels .wheels   (carry: [".wheels"])
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: wheels a device machine lacks (dask's and distributed's own dependencies it has)
WHEELS = ("dask", "distributed", "partd", "locket", "tblib", "tornado", "zict")
#: (section, seconds allowed)
SECTIONS = (("env", 90), ("cupy", 180), ("cluster", 240), ("tiny", 240), ("kernels", 150))


# --- sections (each runs in its own process: `--section NAME`) -----------------------------
def section_env() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        out["nvidia-smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True,
                                           text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        out["nvidia-smi"] = f"unavailable ({type(e).__name__})"
    import dask
    import distributed
    import jax

    from dagdiff.cluster.local import gpu_count
    out["versions"] = {"python": sys.version.split()[0], "jax": jax.__version__,
                       "dask": dask.__version__, "distributed": distributed.__version__}
    out["jax devices"] = [str(d) for d in jax.devices()]
    out["gpu count (dd)"] = gpu_count()
    try:
        import cupy

        out["cupy"] = f"{cupy.__version__}, {cupy.cuda.runtime.getDeviceCount()} device(s)"
    except Exception as e:                       # noqa: BLE001 - report, do not fail
        out["cupy"] = f"unavailable ({type(e).__name__}: {e})"
    return out


def section_cupy() -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                        "tests/test_kernels_math.py", "-k", "cuda or cupy"],
                       cwd=ROOT, capture_output=True, text=True, timeout=170)
    print(r.stdout[-4000:], r.stderr[-2000:])
    last = (r.stdout.strip().splitlines() or [""])[-1]
    return {"pytest": last, "rc": r.returncode}


def _device_of(x: Any) -> str:
    devices = getattr(x, "devices", None)
    if devices is None:
        return type(x).__name__
    return f"{type(x).__name__} on {sorted(str(d.platform) for d in devices())}"


def _send_device_array(to: str, run: str, dask_worker: Any) -> str:
    import jax.numpy as jnp

    from dagdiff.runtime.direct.messages import Value, pack

    x = jnp.arange(4096, dtype=jnp.float32) * 2
    errors: list[Any] = []
    dask_worker.extensions["dagdiff"].transport.send(
        to, Value(run, "k", 1, pack(x)), errors.append)
    return _device_of(x)


def _received_as(run: str, dask_worker: Any) -> str | None:
    st = dask_worker.extensions["dagdiff"]._runs.get(run)
    if st is None or "k" not in st.values:
        return None
    v = st.values["k"][0]
    ok = float(v[3]) == 6.0
    return f"{_device_of(v)}, value {'right' if ok else 'WRONG'}"


def _worker_env(dask_worker: Any) -> dict[str, Any]:
    import jax

    return {"devices": [str(d) for d in jax.devices()],
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")}


def section_cluster() -> dict[str, Any]:
    import statistics

    import dask
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from distributed import Client

    import dagdiff as dd
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import mlp_data, two_stage_loss

    from dagdiff.examples.simulated import sleepy_pipeline

    out: dict[str, Any] = {}
    cluster = dd.local_cluster(n_workers=2, dashboard_address=None, quiet=True)
    client = Client(cluster)
    try:
        out["workers"] = client.run(_worker_env)
        params, batches = mlp_data(64, 64, 4, batches=2)
        x, t = batches[0]
        with client.as_current():
            step = dd.value_and_grad(two_stage_loss, microbatches=8, schedule="1f1b")
            loss, grads = dask.compute(*step(params, x, t))
        ref_l, ref_g = jax.jit(jax.value_and_grad(two_stage_loss))(params, x, t)
        err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                  for a, b in zip(jax.tree_util.tree_leaves(grads),
                                  jax.tree_util.tree_leaves(ref_g)))
        out["1f1b step vs jax.value_and_grad"] = {
            "loss": [float(loss), float(ref_l)], "max grad error": err,
            "jax reference on": str(jax.devices()[0])}
        a, b = sorted(client.scheduler_info()["workers"])
        sent = client.run(_send_device_array, b, "gpu-check", workers=[a])[a]
        got = None
        for _ in range(100):
            got = client.run(_received_as, "gpu-check", workers=[b])[b]
            if got:
                break
            time.sleep(0.05)
        out["a device array between workers"] = {"sent": sent, "received": got}
        trainer = dd.Trainer(sleepy_pipeline(2, 0.0), optax.sgd(1e-3), microbatches=8,
                             schedule="1f1b")
        xs = [jax.random.normal(jax.random.PRNGKey(i), (64, 64)) for i in range(4)]
        state = trainer.init([jnp.float32(1.0)] * 2)
        times = []
        for i in range(40):
            t0 = time.perf_counter()
            state, loss = trainer.step(state, xs[i % 4])
            loss.result()
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trainer.fit([(xs[i % 4],) for i in range(256)], progress=False)
        out["zero-time stages"] = {
            "Trainer.step median ms": round(1e3 * statistics.median(times[10:]), 2),
            "fit ms a step (256 steps)": round(1e3 * (time.perf_counter() - t0) / 256, 2)}
    finally:
        client.close()
        cluster.close()
    return out


def _bench(args: list[str], timeout: float) -> dict[str, Any]:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    text = "\n".join(line for line in r.stdout.splitlines() if " INFO " not in line)
    print(text[-6000:], r.stderr[-1500:] if r.returncode else "")
    return {"rc": r.returncode, "tail": text.strip().splitlines()[-20:]}


def section_tiny() -> dict[str, Any]:
    return _bench(["benchmarks/bench_peers.py", "--width", "64", "--batch", "64", "--layers",
                   "4", "--microbatches", "8", "--steps", "32", "--rounds", "1",
                   "--systems", "jax", "dagdiff", "dagdiff-values", "dagdiff-fitauto"], 230)


def section_kernels() -> dict[str, Any]:
    return _bench(["benchmarks/bench_kernels.py", "--repeat", "3"], 140)


# --- driver ------------------------------------------------------------------------------
def fetch_wheels(where: str) -> None:
    """Here (PyPI reachable): the wheels of `WHEELS` at this machine's versions, for the
    device's Python 3.12 on x86_64."""
    from importlib.metadata import version

    specs = [f"{name}=={version(name)}" for name in WHEELS]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", where,
                    "--only-binary=:all:", "--python-version", "3.12", "--platform",
                    "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
                    *specs], check=True)
    exclude = ROOT / ".git" / "info" / "exclude"           # keep them out of commits
    line = f"/{os.path.normpath(where)}/"
    if exclude.parent.parent.is_dir():
        exclude.parent.mkdir(exist_ok=True)
        if not exclude.exists() or line not in exclude.read_text().split():
            with exclude.open("a") as f:
                f.write(line + "\n")
    print(f"wheels in {where}: {sorted(os.listdir(where))}")


def install(wheels: str) -> None:
    """There: Dask from the carried wheels, dagdiff from this checkout (no network)."""
    found = sorted(str(Path(wheels) / w) for w in os.listdir(wheels) if w.endswith(".whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    *found], check=True)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--no-index", "--no-build-isolation", "-e", str(ROOT)],
                       capture_output=True, text=True)
    if r.returncode:          # no setuptools/wheel there: the checkout on the path will do
        print("dagdiff not installed (" + (r.stderr.strip().splitlines() or ["?"])[-1]
              + "); using it from the checkout")
        os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--section", choices=[s for s, _ in SECTIONS])
    ap.add_argument("--only", nargs="+", choices=[s for s, _ in SECTIONS])
    ap.add_argument("--fetch-wheels", metavar="DIR")
    ap.add_argument("--wheels", metavar="DIR", help="install these first (device machine)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    if a.fetch_wheels:
        fetch_wheels(a.fetch_wheels)
        return
    if a.section:
        got = globals()[f"section_{a.section}"]()
        print("RESULT " + json.dumps(got, default=str))
        return
    if a.wheels:
        install(a.wheels)
    results: dict[str, Any] = {}
    log: list[str] = []
    start = time.monotonic()
    for name, limit in SECTIONS:
        if a.only and name not in a.only:
            continue
        t0 = time.monotonic()
        try:
            r = subprocess.run([sys.executable, __file__, "--section", name], cwd=ROOT,
                               capture_output=True, text=True, timeout=limit)
            text = r.stdout + r.stderr
            line = next((x for x in reversed(r.stdout.splitlines())
                         if x.startswith("RESULT ")), None)
            results[name] = (json.loads(line[7:]) if line else
                             {"failed": f"rc {r.returncode}", "tail": text[-3000:]})
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            results[name] = {"failed": f"over its {limit} s", "tail": text[-3000:]}
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
        log.append(f"===== {name} ({results[name]['seconds']} s)\n{text}")
        print(f"===== {name}: {json.dumps(results[name], default=str)[:3000]}", flush=True)
    results["total seconds"] = round(time.monotonic() - start, 1)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_checks.json").write_text(json.dumps(results, indent=1, default=str))
    (Path(a.out) / "gpu_checks.log").write_text("\n".join(log))
    print(f"wrote {a.out}/gpu_checks.json and gpu_checks.log "
          f"({results['total seconds']} s in all)")


if __name__ == "__main__":
    main()
