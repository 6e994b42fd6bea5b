"""A DistMM-style dual encoder: a text encoder on one worker, a vision encoder split over
two more, features exchanged for a CLIP-style contrastive loss. The backward pass is
derived by dagdiff (DistMM writes backward methods by hand)."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..core.layer import layer
from ..core.stage import stage


__all__ = ["init_params", "clip_loss_fn", "make_batch", "TEXT_STAGE", "VISION_STAGES"]

TEXT_STAGE = 0
VISION_STAGES = (1, 2)


@layer(name="text_embed")
def text_embed(p: Any, tokens: Any) -> Any:
    """Mean of token embeddings (tokens: int [batch, length])."""
    return jnp.mean(p["emb"][tokens], axis=1)


@layer(name="mlp_block")
def mlp_block(p: Any, h: Any) -> Any:
    return h + jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"]


@layer(name="patchify")
def patchify(p: Any, images: Any) -> Any:
    """Images [batch, H, W] -> mean of linear patch embeddings (4x4 patches)."""
    b, hh, ww = images.shape
    patches = images.reshape(b, hh // 4, 4, ww // 4, 4).transpose(0, 1, 3, 2, 4)
    patches = patches.reshape(b, -1, 16)
    return jnp.mean(jnp.tanh(patches @ p["w"] + p["b"]), axis=1)


@layer(name="project")
def project(p: Any, h: Any) -> Any:
    z = h @ p["w"]
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


@layer(name="contrastive")
def contrastive(a: Any, b: Any, log_temp: Any) -> Any:
    logits = a @ b.T * jnp.exp(log_temp)
    n = a.shape[0]
    idx = jnp.arange(n)
    la = -jnp.mean(jax.nn.log_softmax(logits, axis=1)[idx, idx])
    lb = -jnp.mean(jax.nn.log_softmax(logits, axis=0)[idx, idx])
    return (la + lb) / 2


def _block(key: Any, d: int) -> dict[str, Any]:
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (d, 2 * d)) / jnp.sqrt(d), "b1": jnp.zeros(2 * d),
            "w2": jax.random.normal(k2, (2 * d, d)) / jnp.sqrt(2 * d)}


def init_params(key: Any, vocab: int = 50, d: int = 32, out: int = 16) -> dict[str, Any]:
    ks = jax.random.split(key, 8)
    return {
        "text": {"emb": jax.random.normal(ks[0], (vocab, d)) * 0.1,
                 "blocks": [_block(ks[1], d), _block(ks[2], d)],
                 "proj": {"w": jax.random.normal(ks[3], (d, out)) / jnp.sqrt(d)}},
        "vision": {"patch": {"w": jax.random.normal(ks[4], (16, d)) * 0.25, "b": jnp.zeros(d)},
                   "blocks": [_block(ks[5], d), _block(ks[6], d)],
                   "proj": {"w": jax.random.normal(ks[7], (d, out)) / jnp.sqrt(d)}},
        "log_temp": jnp.asarray(2.0),
    }


def clip_loss_fn(params: Any, tokens: Any, images: Any) -> Any:
    """Text encoder on stage 0; vision encoder on stages 1-2; loss back on stage 0."""
    with stage(TEXT_STAGE):
        t = text_embed(params["text"], tokens)
        for blk in params["text"]["blocks"]:
            t = mlp_block(blk, t)
        a = project(params["text"]["proj"], t)
    with stage(VISION_STAGES[0]):
        v = patchify(params["vision"]["patch"], images)
        v = mlp_block(params["vision"]["blocks"][0], v)
    with stage(VISION_STAGES[1]):
        v = mlp_block(params["vision"]["blocks"][1], v)
        b = project(params["vision"]["proj"], v)
    with stage(TEXT_STAGE):
        return contrastive(a, b, params["log_temp"])


def make_batch(key: Any, n: int = 16, length: int = 6, vocab: int = 50) -> tuple[Any, Any]:
    """Synthetic paired data: image brightness patterns tied to token ids."""
    k1, k2 = jax.random.split(key)
    tokens = jax.random.randint(k1, (n, length), 0, vocab)
    base = (tokens[:, :1].astype(jnp.float32) / vocab)[:, :, None]
    images = base + 0.1 * jax.random.normal(k2, (n, 8, 8))
    return tokens, images
