"""Test models written once with dd.layer; each test compares dagdiff with jax.value_and_grad."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import dagdiff as dd


def init_dense(key: Any, sizes: list[int]) -> list[dict[str, Any]]:
    keys = jax.random.split(key, len(sizes))
    return [{"w": jax.random.normal(k, (a, b)) / jnp.sqrt(a), "b": 0.1 * jnp.ones(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


@dd.layer
def dense(p: Any, x: Any) -> Any:
    return jnp.tanh(x @ p["w"] + p["b"])


@dd.layer
def linear(p: Any, x: Any) -> Any:
    return x @ p["w"] + p["b"]


@dd.layer(name="mse")
def mse(y: Any, t: Any) -> Any:
    return jnp.mean((y - t) ** 2)


@dd.layer
def concat(*xs: Any) -> Any:
    return jnp.concatenate(xs, axis=-1)


@dd.layer
def split_gate(p: Any, x: Any) -> tuple[Any, Any]:
    """Multi-input, multi-output: returns (gated, gate)."""
    g = jax.nn.sigmoid(x @ p["wg"])
    return x * g, g


@dd.layer
def softmax_xent(logits: Any, labels: Any) -> Any:
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


@dd.layer
def normalize(z: Any) -> Any:
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


@dd.layer
def clip_loss(a: Any, b: Any, temperature: float) -> Any:
    logits = a @ b.T / temperature
    labels = jnp.arange(a.shape[0])
    la = -jnp.mean(jax.nn.log_softmax(logits, axis=1)[labels, labels])
    lb = -jnp.mean(jax.nn.log_softmax(logits, axis=0)[labels, labels])
    return (la + lb) / 2


def mlp_loss(params: Any, x: Any, t: Any) -> Any:
    h = x
    for p in params:
        h = dense(p, h)
    return mse(h, t)


def staged_loss(params: Any, x: Any, t: Any) -> Any:
    """As many dense layers as `params` has, the first half on stage 0, the rest and the
    loss on stage 1."""
    h = x
    for i, p in enumerate(params):
        with dd.stage(i * 2 // len(params)):
            h = dense(p, h)
    with dd.stage(1):
        return mse(h, t)


def residual_loss(params: Any, x: Any, t: Any) -> Any:
    h = dense(params[0], x)
    h = dense(params[1], h) + h           # skip connection via a traced '+'
    h = 0.5 * dense(params[2], h) - h     # scalar ops on traced values
    return mse(linear(params[3], h), t)


def branch_loss(params: Any, x: Any, t: Any) -> Any:
    h = dense(params["stem"], x)
    branches = [dense(p, h) for p in params["branches"]]   # three parallel branches
    return mse(linear(params["head"], concat(*branches)), t)


def shared_loss(params: Any, x: Any, t: Any) -> Any:
    h = dense(params["shared"], x)
    h = dense(params["shared"], h)          # the same weights twice
    h = dense(params["other"], h)
    return mse(dense(params["shared"], h), t)


def gate_loss(params: Any, x: Any, t: Any) -> Any:
    h = dense(params["in"], x)
    gated, gate = split_gate(params["gate"], h)
    return mse(linear(params["out"], gated) + gate, t)


def classifier_loss(params: Any, x: Any, labels: Any) -> Any:
    h = dense(params[0], x)
    return softmax_xent(linear(params[1], h), labels)


def contrastive_loss(params: Any, text: Any, image: Any) -> Any:
    a = normalize(linear(params["txt_proj"], dense(params["txt"], text)))
    h = image
    for p in params["img"]:
        h = dense(p, h)
    b = normalize(linear(params["img_proj"], h))
    return clip_loss(a, b, 0.1)


def config_loss(params: Any, x: Any, t: Any, cfg: Any) -> Any:
    h = x
    for i in range(cfg["depth"]):             # loop count from config
        p = params[i % len(params)]
        h = dense(p, h) + h if cfg["residual"] else dense(p, h)
    return mse(h, t)


def optax_reference(loss_fn: Any, opt: Any, params: Any, batches: Any) -> tuple[Any, list[float]]:
    """Plain JAX + optax over `batches`: the parameters after the last step and each
    step's loss (the reference for a Trainer's steps)."""
    import optax

    state, losses = opt.init(params), []
    for batch in batches:
        value, g = jax.value_and_grad(loss_fn)(params, *batch)
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(value))
    return params, losses


# --- shared by the pipeline tests -------------------------------------------------------
#: the key of the pipeline tests' data (`data`)
PIPE_KEY = jax.random.PRNGKey(7)


def make_loss(n_stages: int) -> Any:
    """A chain of n_stages dense layers, one per stage, and an mse loss on the last."""
    def loss_fn(params: Any, x: Any, t: Any) -> Any:
        h = x
        for s in range(n_stages):
            with dd.stage(s):
                h = dense(params[s], h)
        with dd.stage(n_stages - 1):
            return mse(h, t)
    return loss_fn


def data(n_stages: int, batch: int = 16, width: int = 8) -> tuple[Any, Any, Any]:
    """Parameters for `make_loss(n_stages)`, an input batch and targets."""
    params = init_dense(PIPE_KEY, [width] * (n_stages + 1))
    x = jax.random.normal(jax.random.fold_in(PIPE_KEY, 1), (batch, width))
    t = jax.random.normal(jax.random.fold_in(PIPE_KEY, 2), (batch, width))
    return params, x, t


def close(got: Any, want: Any) -> None:
    """Every leaf of `got` equals `want`'s (rtol 1e-5, atol 1e-6)."""
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def assert_matches_jax(fn: Any, args: tuple[Any, ...], got_l: Any, got_g: Any) -> None:
    """Loss and grads equal `jax.value_and_grad(fn)(*args)`."""
    want_l, want_g = jax.value_and_grad(fn)(*args)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    close(got_g, want_g)


def probe_every(seconds: float, after: float | None = None) -> tuple[float, float]:
    """Set direct dispatch's probe timing in this process; returns the old values."""
    from dagdiff.runtime.direct import run as rt_mod

    old = (rt_mod.PROBE_AFTER, rt_mod.PROBE_EVERY)
    rt_mod.PROBE_AFTER, rt_mod.PROBE_EVERY = seconds, (seconds if after is None else after)
    return old
