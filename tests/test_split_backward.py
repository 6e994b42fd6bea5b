"""A zero-bubble schedule's split backward shares its work: W runs from what I computed
(`dagdiff.core.split`), and the numbers equal JAX's whatever order the tasks run in."""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dagdiff as dd
from dagdiff.runtime import compiled as compiled_mod
from dagdiff.core.split import partition
from dagdiff.runtime.tasks import FwdResult, fwd_task, vjp_task
from tests.models import close, data, make_loss


def stack(b0: Any, w0: Any, b1: Any, w1: Any, b2: Any, w2: Any, h: Any) -> Any:
    for b, w in ((b0, w0), (b1, w1), (b2, w2)):
        h = jnp.tanh(h @ w + b)
    return h


def stack_args() -> list[Any]:
    key = jax.random.PRNGKey(0)
    out = []
    for i in range(3):
        out += [jnp.full((5,), 0.1 * i),
                jax.random.normal(jax.random.fold_in(key, i), (5, 5)) / 3]
    return out + [jax.random.normal(jax.random.fold_in(key, 9), (4, 5))]


def dots(closed: Any) -> int:
    """Matrix products the jaxpr's outputs need (dead equations left out)."""
    live = {v for v in closed.jaxpr.outvars if hasattr(v, "aval") and not hasattr(v, "val")}
    n = 0
    for e in reversed(closed.jaxpr.eqns):
        if any(o in live for o in e.outvars):
            n += e.primitive.name == "dot_general"
            live.update(v for v in e.invars if not hasattr(v, "val"))
    return n


def traced_backward(fn: Any, args: list[Any], first: list[int], second: list[int]) -> Any:
    """The jaxpr of `fn`'s backward from its pullback's residuals and a cotangent, with
    outputs: the gradients of `first`, then those of `second`."""
    out, pb = jax.vjp(fn, *args)
    leaves, tree = jax.tree_util.tree_flatten(pb)
    ct = jnp.ones_like(out)

    def whole(pl: list[Any], c: Any) -> list[Any]:
        g = jax.tree_util.tree_unflatten(tree, pl)(c)
        return [g[i] for i in first] + [g[i] for i in second]

    return jax.make_jaxpr(whole)(leaves, ct), [*leaves, ct], pb(ct)


def test_the_two_parts_walk_the_chain_once_and_equal_the_pullback() -> None:
    args = stack_args()
    first, second = [6], [0, 1, 2, 3, 4, 5]            # I: the activation; W: b, w
    closed, flat, want = traced_backward(stack, args, first, second)
    parts = partition(closed, len(first))
    assert parts is not None
    got_i, stash = parts.run_first(flat)
    got_w = parts.run_second(stash)
    for g, i in zip(list(got_i) + list(got_w), first + second):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want[i]), rtol=1e-6, atol=1e-7)
    # the whole backward has 6 products: 3 down the chain (I), 3 for the weights (W); W
    # on its own would walk the chain again (2 more)
    one, two = parts.jaxprs
    assert dots(closed) == 6 and dots(one) == 3 and dots(two) == 3
    w_alone, _, _ = traced_backward(stack, args, second, [])
    assert dots(w_alone) == 5
    # what I hands on: each layer's pre-activation cotangent (4 x 5), not the weights
    assert parts.n_carry == 3
    assert all(np.shape(x) == (4, 5) for x in stash[len(parts.kept):])


def test_nothing_shared_or_a_nested_call_is_not_split() -> None:
    def apart(w: Any, x: Any) -> Any:
        return jnp.sin(w) * 2.0, jnp.cos(x)

    out, pb = jax.vjp(apart, jnp.ones(3), jnp.ones(3))
    leaves, tree = jax.tree_util.tree_flatten(pb)
    closed = jax.make_jaxpr(
        lambda pl, c: list(jax.tree_util.tree_unflatten(tree, pl)(c))[::-1])(leaves, out)
    assert partition(closed, 1) is None

    inner = jax.jit(lambda w, h: jnp.tanh(h @ w))
    args = [jnp.ones((3, 3)) / 3, jnp.ones((3, 3)) / 3, jnp.ones((2, 3))]
    closed, _, _ = traced_backward(lambda w1, w2, h: inner(w2, inner(w1, h)), args, [2],
                                   [0, 1])
    assert partition(closed, 1) is None            # the chain sits inside the inner jit


class Calls:
    """Counts the plain (unsplit) jitted backward and forward+backward calls."""

    def __init__(self, monkeypatch: Any) -> None:
        self.bwd = self.fwd_grad = self.remat = 0
        original = compiled_mod._Compiled.__init__

        def init(c: Any, spec: Any) -> None:
            original(c, spec)
            for name in ("bwd", "fwd_grad", "remat_bwd"):
                fn = getattr(c, name)
                setattr(c, name, self._counted(name, fn))

        monkeypatch.setattr(compiled_mod._Compiled, "__init__", init)
        monkeypatch.setattr(compiled_mod, "_CACHE", collections.OrderedDict())

    def _counted(self, name: str, fn: Any) -> Any:
        attr = {"remat_bwd": "remat"}.get(name, name)

        def run(*a: Any, **k: Any) -> Any:
            setattr(self, attr, getattr(self, attr) + 1)
            return fn(*a, **k)
        return run


@pytest.mark.parametrize("n_stages", [2, 3])
def test_a_zb_step_runs_each_w_from_its_i_and_equals_jax(monkeypatch: Any,
                                                         n_stages: int) -> None:
    calls = Calls(monkeypatch)
    fn = make_loss(n_stages)
    params, x, t = data(n_stages, batch=8)
    want_l, want_g = jax.value_and_grad(fn)(params, x, t)
    loss, grads = dd.value_and_grad(fn, microbatches=4, schedule="zb-h1")(params, x, t)
    got_l, got_g = dask.compute(loss, grads, scheduler="sync")
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    close(got_g, want_g)
    # stage 0 has no I (its input is data): one plain backward per microbatch; the loss
    # stage's forward runs its I with it, and every split call's W runs from its I
    assert (calls.bwd, calls.fwd_grad, calls.remat) == (4, 0, 0)
    splits = [s for c in compiled_mod._CACHE.values() for s in c._splits.values()]
    assert splits and all(s is not None for s in splits)
    assert len(splits) == (1 if n_stages == 2 else 2)    # one signature per split call


def split_call(n_stages: int) -> tuple[dict[str, Any], str, str, str, dict[str, Any]]:
    """Stage 1's forward, I and W tasks of a ZB-H1 step (m = 1) and the other values
    they read."""
    fn = make_loss(n_stages)
    dsk = dd.trace(fn, microbatches=1, schedule="zb-h1")(*data(n_stages, batch=4)).dsk
    fk = next(k for k, t in dsk.items() if getattr(t, "func", None) is fwd_task
              and "-s1-" in k)
    own = [k for k, t in dsk.items() if getattr(t, "func", None) is vjp_task
           and getattr(t.args[5], "key", None) == fk]       # the tasks of fk's backward
    i_key = next(k for k in own if dsk[k].kwargs.get("then"))
    w_key = next(k for k in own if dsk[k].kwargs.get("release"))
    others = sorted((set(dsk[fk].dependencies) | set(dsk[i_key].dependencies)
                     | set(dsk[w_key].dependencies)) - {fk, i_key})
    return dsk, fk, i_key, w_key, dict(zip(others, dask.get(dsk, others)))


def test_w_before_i_or_i_twice_gives_the_same_gradients(monkeypatch: Any) -> None:
    calls = Calls(monkeypatch)
    dsk, fk, i_key, w_key, vals = split_call(3)

    def run(order: list[str]) -> dict[str, Any]:
        fwd = dsk[fk](vals)
        assert isinstance(fwd, FwdResult) and fwd.pullback is not None
        got: dict[str, Any] = {}
        for k in order:       # W's ordering edge on I is only read for order: any value
            got[k] = dsk[k]({**vals, fk: fwd, i_key: got.get(i_key)})
        assert fwd.pullback is None and fwd.carry is None   # released after W
        return got

    usual = run([i_key, w_key])
    # W first: the plain backward (no carry yet), then I rebuilds the released pullback:
    # an independent path to the same numbers
    for order in ([w_key, i_key], [i_key, i_key, w_key]):
        other = run(order)
        for k in (i_key, w_key):
            close(other[k], usual[k])
    assert calls.remat == 1 and calls.bwd >= 1       # the W-first run took the plain path


def test_the_loss_stage_runs_its_i_with_its_forward() -> None:
    fn = make_loss(2)
    dsk = dd.trace(fn, microbatches=4, schedule="zb-h1")(*data(2)).dsk
    fused = {k: t.kwargs["split"] for k, t in dsk.items()
             if getattr(t, "func", None) is fwd_task and t.kwargs.get("split")}
    # stage 1 (dense + mse) in each of the 4 microbatches: I w.r.t. its activation input
    # (leaf 2 after b, w), W w.r.t. its parameters
    assert len(fused) == 4 and all(k.startswith("fwd_s1_") for k in fused)
    assert set(fused.values()) == {((2,), (0, 1))}


def test_a_split_that_fails_to_compile_falls_back_to_the_plain_backward(
        monkeypatch: Any, caplog: Any) -> None:
    """(jax internals differ between versions: a part that cannot be compiled must not
    fail the step.)"""
    from dagdiff.core import split as split_mod

    def broken(*a: Any) -> Any:
        raise RuntimeError("cannot lower this part")

    real = split_mod.partition

    def partition_broken(closed: Any, n_first: int) -> Any:
        parts = real(closed, n_first)
        return None if parts is None else dataclasses.replace(parts, first=broken)

    monkeypatch.setattr(compiled_mod, "partition", partition_broken)
    monkeypatch.setattr(compiled_mod, "_CACHE", collections.OrderedDict())
    fn = make_loss(3)
    params, x, t = data(3, batch=8)
    want_l, want_g = jax.value_and_grad(fn)(params, x, t)
    with caplog.at_level("WARNING", logger="dagdiff.runtime.compiled"):
        loss, grads = dd.value_and_grad(fn, microbatches=2, schedule="zb-h1")(params, x, t)
        got_l, got_g = dask.compute(loss, grads, scheduler="sync")
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    close(got_g, want_g)
    assert "could not split" in caplog.text
    assert all(s is None for c in compiled_mod._CACHE.values() for s in c._splits.values())
