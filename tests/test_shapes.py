"""What one stage hands the next (tuples, dicts, None leaves, dataclass pytrees with an
int mask and a Python int) and batches whose shapes change per step, each against
`jax.value_and_grad` of the same function."""
from __future__ import annotations

import dataclasses
from typing import Any

import dask
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dagdiff as dd
from dagdiff.runtime import compiled

D = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Carry:
    """A dataclass pytree between stages: two arrays and a static field."""

    h: Any
    mask: Any
    scale: float = dataclasses.field(default=1.0, metadata={"static": True})


def pack(kind: str, h: Any, mask: Any) -> Any:
    if kind == "tuple":
        return (h, mask, 3)
    if kind == "dict":
        return {"h": h, "mask": mask, "n": 3, "nothing": None}
    return Carry(h, mask, scale=0.5)


def unpack(kind: str, carry: Any) -> tuple[Any, Any, Any]:
    if kind == "tuple":
        h, mask, n = carry
        return h, mask, n
    if kind == "dict":
        assert carry["nothing"] is None
        return carry["h"], carry["mask"], carry["n"]
    return carry.h, carry.mask, 1 / carry.scale


def make_loss(kind: str) -> Any:
    @dd.layer(name="encode", stage=0)
    def encode(p: Any, x: Any, mask: Any) -> Any:
        return pack(kind, jnp.tanh(x @ p["w"]), mask)

    @dd.layer(name="head", stage=1)
    def head(p: Any, carry: Any, t: Any) -> Any:
        h, mask, n = unpack(kind, carry)
        m = mask.astype(h.dtype)[..., None]
        y = (h @ p["w"]) * m
        per_row = jnp.sum((y - t * m) ** 2, axis=(1, 2)) / (jnp.sum(m, axis=(1, 2)) + 1)
        return jnp.mean(per_row) / n            # a mean over rows: microbatches agree

    def loss(params: Any, x: Any, mask: Any, t: Any) -> Any:
        return head(params["head"], encode(params["enc"], x, mask), t)

    return loss


def params_() -> Any:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"enc": {"w": jax.random.normal(k1, (D, D)) / 3},
            "head": {"w": jax.random.normal(k2, (D, D)) / 3}}


def batch(length: int, seed: int = 1) -> tuple[Any, Any, Any]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(k1, (4, length, D))
    t = jax.random.normal(k2, (4, length, D))
    mask = (jnp.arange(length)[None, :] < jnp.array([[length], [length - 1], [3], [1]])
            ).astype(jnp.int32)
    return x, mask, t


def check(loss: Any, got: Any, params: Any, *args: Any) -> None:
    want_loss, want = jax.value_and_grad(loss)(params, *args)
    np.testing.assert_allclose(got[0], want_loss, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["tuple", "dict", "dataclass"])
def test_a_stage_hands_the_next_a_pytree_with_an_int_mask_and_static_parts(kind: str) -> None:
    loss, params, args = make_loss(kind), params_(), batch(6)
    step = dd.value_and_grad(loss, microbatches=2, schedule="1f1b")
    check(loss, dask.compute(*step(params, *args)), params, *args)


@pytest.mark.distributed
def test_pytrees_between_stages_on_the_cluster(client2: Any) -> None:
    params, args = params_(), batch(6)
    with client2.as_current():
        for kind in ("tuple", "dict", "dataclass"):
            loss = make_loss(kind)
            step = dd.value_and_grad(loss, microbatches=2, schedule="1f1b")
            check(loss, step.compute(params, *args), params, *args)


@pytest.mark.slow
def test_lengths_that_change_per_step_compile_once_per_shape() -> None:
    loss, params = make_loss("tuple"), params_()
    step = dd.value_and_grad(loss, microbatches=2, schedule="1f1b")
    seen: dict[int, int] = {}
    for length in (8, 13, 8, 21, 13):
        before = compiled.compile_count()
        args = batch(length, seed=length)
        check(loss, dask.compute(*step(params, *args), scheduler="sync"), params, *args)
        seen.setdefault(length, 0)
        seen[length] += compiled.compile_count() - before
    # new lengths compile each layer (encode, head) once; lengths seen before compile nothing
    assert seen[8] == seen[13] == seen[21] == 2, seen


@pytest.mark.slow
def test_pad_to_bucket_keeps_the_loss_and_bounds_the_shapes() -> None:
    loss, params = make_loss("tuple"), params_()
    step = dd.value_and_grad(loss, microbatches=2, schedule="1f1b")
    shapes = set()
    for length in (5, 11, 3):
        x, mask, t = batch(length, seed=length)
        (xp, tp), pmask = dd.pad_to_bucket((x, t), buckets=(8, 16), axis=1)
        maskp, _ = dd.pad_to_bucket(mask, buckets=(8, 16), axis=1)
        assert pmask.shape == xp.shape[:2] and bool(pmask[:, :length].all())
        assert not bool(pmask[:, length:].any())
        shapes.add(xp.shape)
        got = dask.compute(*step(params, xp, maskp, tp))
        # the padded positions are masked: the loss equals the unpadded batch's
        want = jax.value_and_grad(loss)(params, x, mask, t)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
        for a, b in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want[1])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert shapes == {(4, 8, D), (4, 16, D)}


def test_pad_to_bucket_masks_per_row_lengths_and_refuses_what_does_not_fit() -> None:
    tokens = np.arange(2 * 5).reshape(2, 5)
    padded, mask = dd.pad_to_bucket(tokens, 4, lengths=[5, 2], value=-1)
    assert padded.shape == (2, 8) and (padded[:, 5:] == -1).all()
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]])
    with pytest.raises(dd.ArgumentError, match="longer than the largest bucket 4"):
        dd.pad_to_bucket(tokens, (2, 4))
    with pytest.raises(dd.ArgumentError, match="differ in length"):
        dd.pad_to_bucket((tokens, tokens[:, :3]), 8)
    # the same axis counted from the end gives the same (it was refused)
    padded_neg, mask_neg = dd.pad_to_bucket(tokens, 4, axis=-1, lengths=[5, 2], value=-1)
    np.testing.assert_array_equal(padded_neg, padded)
    np.testing.assert_array_equal(mask_neg, mask)
    with pytest.raises(dd.ArgumentError, match="names different axes"):
        dd.pad_to_bucket((tokens, tokens[..., None]), 8, axis=-1)


@pytest.mark.slow
def test_the_signature_cache_is_bounded() -> None:
    loss, params = make_loss("tuple"), params_()
    step = dd.value_and_grad(loss, fuse=True)      # one signature per length
    with dask.config.set({"dagdiff.compiled-signatures": 3}):
        before = compiled.cache_info()
        for length in (30, 31, 32, 33):
            args = batch(length, seed=length)
            check(loss, dask.compute(*step(params, *args), scheduler="sync"), params, *args)
        info = compiled.cache_info()
    assert info["cached"] <= 3 and info["limit"] == 3
    assert info["evicted"] - before["evicted"] >= 1
