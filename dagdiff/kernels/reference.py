"""Plain ``jax.numpy`` reference implementations of the hand-written kernels (for tests)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


__all__ = ["bias_gelu_ref", "softmax_cross_entropy_ref", "layer_norm_ref"]


def bias_gelu_ref(x: jax.Array, b: jax.Array) -> jax.Array:
    """tanh-approximation GELU of ``x + b`` (``x: [..., d]``, ``b: [d]``)."""
    z = x + b
    c = jnp.sqrt(2.0 / jnp.pi).astype(z.dtype)
    return 0.5 * z * (1.0 + jnp.tanh(c * (z + 0.044715 * z**3)))


def softmax_cross_entropy_ref(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean over rows of ``-log softmax(logits)[label]`` (``logits: [n, V]``, ``labels: [n]``)."""
    shifted = logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    log_probs = shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
    picked = jnp.take_along_axis(log_probs, labels[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return -jnp.mean(picked)


def layer_norm_ref(
    x: jax.Array, gamma: jax.Array, beta: jax.Array, eps: float = 1e-5
) -> jax.Array:
    """Layer norm over the last axis with biased variance: ``(x - mean) / sqrt(var + eps)``."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    return centred * jax.lax.rsqrt(var + eps) * gamma + beta
