"""Screenshots of the Dask dashboard while `dd.Trainer.fit` runs a direct-dispatch pipeline.

Starts a 2-worker `dd.local_cluster` with its dashboard, trains a small 2-stage MLP with
1F1B x8 (`Trainer.fit` in a thread), and meanwhile has headless Chromium take pictures
of Task Stream (``/individual-task-stream``, zoomed to the last two steps as with the
box-zoom tool) and of the status page: each action of the programs (``fwd_<layer>``,
``vjp_<layer>``, ...) is a bar of its own on its worker's action row, so the schedule's
diagonal shows while the pipeline runs (`dagdiff.runtime.live`). Writes
docs/dashboard-task-stream.png and docs/dashboard-status.png (needs ``chromium``, Debian's
package of that name).
Usage: python docs/dashboard_screenshots.py [--seconds 30] [--out docs] [--port 8790]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from typing import Any

import jax
import jax.numpy as jnp
import optax
from distributed import Client

import dagdiff as dd


# Dask colours a bar by its task prefix (a hash into its palette); with these names the
# forwards are green and the backwards dark purple on both stages (fwd_s0_dense_x2,
# vjp_s0_dense_x2 on stage 0; fwd_s1_gelu_x2_mse, vjp_s1_gelu_x2_mse on stage 1)
@dd.layer
def dense(p: Any, x: Any) -> Any:
    return jnp.tanh(x @ p["w"] + p["b"])


@dd.layer
def gelu(p: Any, x: Any) -> Any:
    return jax.nn.gelu(x @ p["w"] + p["b"])


@dd.layer
def mse(y: Any, t: Any) -> Any:
    return jnp.mean((y - t) ** 2)


def loss_fn(params: Any, x: Any, t: Any) -> Any:
    h = x
    half = len(params) // 2
    for i, p in enumerate(params):
        with dd.stage(i // half):
            h = (dense if i < half else gelu)(p, h)
    with dd.stage(1):
        return mse(h, t)


#: zoom Task Stream to the last `steps` steps' programs (as a user does with box zoom)
_ZOOM = """
(() => {
  const fig = Bokeh.documents[0].get_model_by_name("task_stream");
  const d = fig.renderers[0].data_source.data;
  const progs = [];
  for (let i = 0; i < d.name.length; i++)
    if (d.name[i].startsWith("prog_"))
      progs.push([d.start[i] - d.duration[i] / 2, d.start[i] + d.duration[i] / 2]);
  progs.sort((a, b) => a[1] - b[1]);
  const last = progs.slice(-2 * %(steps)d);
  if (!last.length) return 0;
  const a = Math.min(...last.map(p => p[0])), b = Math.max(...last.map(p => p[1]));
  fig.x_range.have_updated_interactively = true;
  fig.x_range.setv({start: a - 0.05 * (b - a), end: b + 0.05 * (b - a)});
  return last.length;
})()
"""


async def _shoot(url: str, path: str, size: tuple[int, int], wait: float,
                 zoom_steps: int, port: int) -> None:
    from tornado.websocket import websocket_connect   # distributed's own dependency

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("needs chromium (Debian: apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen([browser, "--headless=new", "--no-sandbox", "--disable-gpu",
                                 "--hide-scrollbars", f"--user-data-dir={profile}",
                                 f"--remote-debugging-port={port}",
                                 f"--window-size={size[0]},{size[1]}", "about:blank"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(200):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json") as r:
                        tabs = json.load(r)
                    target = next(t for t in tabs if t["type"] == "page")
                    break
                except Exception:                  # noqa: BLE001 - not listening yet
                    await asyncio.sleep(0.1)
            else:
                raise SystemExit("chromium's DevTools endpoint did not come up")
            ws = await websocket_connect(target["webSocketDebuggerUrl"],
                                         max_message_size=1 << 28)
            ids = itertools.count(1)

            async def call(method: str, **params: Any) -> Any:
                i = next(ids)
                await ws.write_message(json.dumps({"id": i, "method": method,
                                                   "params": params}))
                while True:
                    msg = json.loads(await ws.read_message())
                    if msg.get("id") == i:
                        return msg.get("result")

            await call("Emulation.setDeviceMetricsOverride", width=size[0], height=size[1],
                       deviceScaleFactor=1, mobile=False)
            await call("Page.navigate", url=url)
            await asyncio.sleep(wait)              # bokeh's session connects and draws
            if zoom_steps:
                await call("Runtime.evaluate", expression=_ZOOM % {"steps": zoom_steps})
                await asyncio.sleep(0.5)
            shot = await call("Page.captureScreenshot", format="png")
            with open(path, "wb") as f:
                f.write(base64.b64decode(shot["data"]))
            ws.close()
        finally:
            proc.terminate()
            proc.wait()


def screenshot(url: str, path: str, size: tuple[int, int] = (1400, 700), wait: float = 6.0,
               zoom_steps: int = 0, port: int = 9333) -> None:
    """A headless Chromium picture of `url`, `wait` s after it starts loading (driven
    over the DevTools protocol: bokeh's pages draw over a websocket, which a plain
    ``--screenshot`` with a virtual-time budget does not wait for); `zoom_steps`: zoom
    Task Stream to the last that many steps."""
    asyncio.run(_shoot(url, path, size, wait, zoom_steps, port))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=30.0, help="training time (default 30)")
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--port", type=int, default=8790)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--microbatches", type=int, default=8)
    a = ap.parse_args()
    cluster = dd.local_cluster(n_workers=2, dashboard_address=f"127.0.0.1:{a.port}",
                               quiet=True, env={"XLA_FLAGS": ""})
    client = Client(cluster)
    key = jax.random.PRNGKey(0)
    params = [{"w": jax.random.normal(jax.random.fold_in(key, i), (a.width, a.width))
               / a.width**0.5, "b": jnp.zeros(a.width)} for i in range(4)]
    batches = [(jax.random.normal(jax.random.fold_in(key, 10 + i), (a.batch, a.width)),
                jax.random.normal(jax.random.fold_in(key, 99 + i), (a.batch, a.width)))
               for i in range(4)]
    tr = dd.Trainer(loss_fn, optax.adam(1e-3), microbatches=a.microbatches, schedule="1f1b",
                    client=client)
    stop = threading.Event()

    def train() -> None:
        state, _ = tr.fit(batches, steps=4, params=params, progress=False)  # compile
        while not stop.is_set():
            state, _ = tr.fit(itertools.cycle(batches), steps=8, state=state, progress=False)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{a.port}"
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    try:
        time.sleep(a.seconds * 0.6)                    # past compiling: steady training
        screenshot(f"{base}/individual-task-stream",
                   os.path.join(a.out, "dashboard-task-stream.png"), zoom_steps=2)
        screenshot(f"{base}/status", os.path.join(a.out, "dashboard-status.png"),
                   size=(1400, 900))
        time.sleep(max(0.0, a.seconds - (time.time() - t0)))
    finally:
        stop.set()
        thread.join(timeout=60)
        client.close()
        cluster.close()
    for name in ("task-stream", "status"):
        print("wrote", os.path.join(a.out, f"dashboard-{name}.png"))


if __name__ == "__main__":
    main()
