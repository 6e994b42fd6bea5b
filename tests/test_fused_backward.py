"""The loss's call computes its forward and backward as one jitted call where its VJP runs
right after it: which tasks fuse (literal schedule tables), and the numbers equal JAX's."""
from __future__ import annotations

import pickle
from typing import Any

import dask
import jax
import numpy as np
import pytest

import dagdiff as dd
from dagdiff.lowering.pipeline import fused_microbatches
from dagdiff.runtime.tasks import FwdResult, vjp_task
from dagdiff.schedules import get_schedule
from tests import models as M
from tests.models import close, data, make_loss


def seeded(fn: Any, args: Any, **options: Any) -> list[str]:
    """The forward tasks of a step that compute their backward with them."""
    dsk = dd.trace(fn, **options)(*args).dsk
    return sorted(k for k, t in dsk.items()
                  if getattr(t, "kwargs", {}).get("seed") is not None)


def test_fused_pairs_follow_the_schedule_tables() -> None:
    trace = dd.trace(make_loss(2), microbatches=4, schedule="1f1b")(*data(2)).trace
    # 1F1B, p = 2, m = 4: stage 0 runs F0 F1 B0 F2 B1 F3 B2 B3 (no F right before its
    # B), stage 1 F0 B0 F1 B1 F2 B2 F3 B3
    assert fused_microbatches(trace, get_schedule("1f1b"), 4) == \
        {(1, 0), (1, 1), (1, 2), (1, 3)}
    # GPipe: every F waits for the other forwards before its B
    assert fused_microbatches(trace, get_schedule("gpipe"), 4) == set()
    assert fused_microbatches(trace, get_schedule("gpipe"), 1) == {(0, 0), (1, 0)}
    # ZB-H1 (split backward: F then I fuses, W runs later from I's carry): stage 0 runs
    # F0 F1 I0 W0 F2 I1 W1 F3 I2 W2 I3 W3, stage 1 F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3
    assert fused_microbatches(trace, get_schedule("zb-h1"), 4) == \
        {(1, 0), (1, 1), (1, 2), (1, 3)}
    # ZB-V (V layout: the loss chunk is worker 0's chunk 1, model stage 3):
    # worker 0 runs ... F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 ... F3.1 I3.1 W3.1 ...
    trace4 = dd.trace(make_loss(4), microbatches=4, schedule="zb-v")(*data(4)).trace
    assert {(s, mb) for s, mb in fused_microbatches(trace4, get_schedule("zb-v"), 4)
            if s == 3} == {(3, 0), (3, 1), (3, 2), (3, 3)}


def test_only_the_calls_that_make_the_loss_fuse_and_only_where_adjacent() -> None:
    args = data(2)
    fn = make_loss(2)
    got = seeded(fn, args, microbatches=4, schedule="1f1b")
    # stage 1 (dense + mse, fused into one call) in every microbatch; stage 0's own
    # cotangent comes from stage 1, so it never fuses
    assert len(got) == 4 and all(k.startswith("fwd_s1_") for k in got), got
    assert seeded(fn, args, microbatches=4, schedule="gpipe") == []
    # no microbatches: only the mse call's cotangent is the seed
    plain = seeded(fn, args)
    assert len(plain) == 1 and plain[0].startswith("fwd_mse"), plain
    assert len(seeded(fn, args, fuse=True)) == 1
    with dask.config.set({"dagdiff.fuse-loss-backward": False}):
        assert seeded(fn, args, microbatches=4, schedule="1f1b") == seeded(fn, args) == []


@pytest.mark.parametrize("options", [
    {}, {"fuse": True}, {"microbatches": 4, "schedule": "1f1b"},
    {"microbatches": 1, "schedule": "1f1b"}, {"microbatches": 4, "schedule": "zb-v"},
    {"microbatches": 4, "schedule": "zb-h1"},
])
def test_fused_steps_equal_jax(options: dict[str, Any]) -> None:
    n = 4 if options.get("schedule") == "zb-v" else 2
    fn = make_loss(n)
    params, x, t = data(n, batch=8)
    assert seeded(fn, (params, x, t), **options)
    want_l, want_g = jax.value_and_grad(fn)(params, x, t)
    loss, grads = dd.value_and_grad(fn, **options)(params, x, t)
    got_l, got_g = dask.compute(loss, grads, scheduler="threads")
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    close(got_g, want_g)


def test_a_fused_forward_result_that_moved_rebuilds_its_backward() -> None:
    """A copy on another worker carries the outputs only; its VJP recomputes from the
    primals and gets the same cotangents (d mean((y - x)^2) / dy, by JAX)."""
    def f(p: Any, x: Any) -> Any:
        return M.mse(M.dense(p, x), x)

    params = M.init_dense(jax.random.PRNGKey(3), [4, 4])[0]
    x = jax.random.normal(jax.random.PRNGKey(4), (3, 4))
    dsk = dd.trace(f)(params, x).dsk
    fk = next(k for k, t in dsk.items() if getattr(t, "kwargs", {}).get("seed") is not None)
    vk = next(k for k, t in dsk.items()
              if getattr(t, "func", None) is vjp_task and fk in t.dependencies)
    others = sorted((set(dsk[fk].dependencies) | set(dsk[vk].dependencies)) - {fk})
    vals = dict(zip(others, dask.get(dsk, others)))
    fwd = dsk[fk](vals)
    assert isinstance(fwd, FwdResult) and fwd.grads is not None and fwd.pullback is None
    moved = pickle.loads(pickle.dumps(fwd))
    assert moved.grads is None and moved.moved
    there = dsk[vk]({**vals, fk: moved})
    here = dsk[vk]({**vals, fk: fwd})
    assert fwd.grads is None                # released after its last backward task
    y = np.tanh(np.asarray(x) @ np.asarray(params["w"]) + np.asarray(params["b"]))
    want = jax.grad(lambda yy: ((yy - x) ** 2).mean())(y)
    np.testing.assert_allclose(np.asarray(here[0]), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(there[0]), want, rtol=1e-5, atol=1e-7)
