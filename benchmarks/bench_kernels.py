"""Hand-written kernels (NumPy path on CPU) vs the jax.numpy reference under jax.jit:
forward + VJP time of each, side by side, printed as ratios.

GPU check (on a machine with CUDA + CuPy): run the same script; it adds the CuPy/CUDA
kernels (`cuda_fwd`/`cuda_bwd`) vs the JAX reference on the GPU.
Usage: python benchmarks/bench_kernels.py [--rows 4096] [--width 1024] [--vocab 32000]
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from dagdiff.kernels import KERNELS, gpu_available
from dagdiff.kernels import reference as R


def timeit(fn: Callable[[], Any], repeat: int) -> float:
    jax.block_until_ready(fn())
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(a.rows, a.width)).astype(np.float32)
    b = rng.normal(size=a.width).astype(np.float32)
    g = rng.normal(size=a.width).astype(np.float32)
    logits = rng.normal(size=(a.rows // 4, a.vocab)).astype(np.float32) * 3
    labels = rng.integers(0, a.vocab, a.rows // 4).astype(np.int32)
    cases = {
        "bias_gelu": ((x, b), {}, R.bias_gelu_ref),
        "layer_norm": ((x, g, b), {"eps": 1e-5}, R.layer_norm_ref),
        "softmax_cross_entropy": ((logits, labels), {}, R.softmax_cross_entropy_ref),
    }
    print(f"{'kernel':<24} {'numpy fwd+vjp ms':>17} {'jax.jit ms':>11} {'ratio':>6}")
    for name, (args, static, ref) in cases.items():
        spec = KERNELS[name]

        def np_path() -> Any:
            out, res = spec.numpy_fwd(*args, **static)
            return spec.numpy_bwd(res, np.ones_like(out))

        n_diff = sum(np.issubdtype(np.asarray(v).dtype, np.floating) for v in args)
        jargs = tuple(jnp.asarray(v) for v in args)

        @jax.jit
        def jax_path(*xs: Any) -> Any:
            out, pb = jax.vjp(lambda *d: ref(*d, *xs[n_diff:], **static), *xs[:n_diff])
            return pb(jnp.ones_like(out))

        t_np = timeit(np_path, a.repeat)
        t_jx = timeit(lambda: jax_path(*jargs), a.repeat)
        print(f"{name:<24} {t_np * 1e3:>17.2f} {t_jx * 1e3:>11.2f} {t_np / t_jx:>6.2f}")
    if gpu_available():
        print("GPU: CuPy kernels vs jax.jit on the GPU")
        for name, (args, static, ref) in cases.items():
            spec = KERNELS[name]
            dargs = tuple(jax.device_put(v) for v in args)

            def cu_path() -> Any:
                out, res = spec.fwd(*dargs, **static)
                return spec.bwd(res, jnp.ones_like(out))

            print(f"{name:<24} cuda fwd+vjp {timeit(cu_path, a.repeat) * 1e3:.2f} ms")
    else:
        print("(no GPU here: run this script on a CUDA machine with CuPy for the GPU figures)")


if __name__ == "__main__":
    main()
