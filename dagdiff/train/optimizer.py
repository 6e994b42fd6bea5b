"""The optax update of one stage's parameters, run as a task on the stage's worker, with
its jitted step cached per worker process."""
from __future__ import annotations

import re
import threading
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..core.byvalue import payload, revive
from ..errors import OptimizerError
from ..runtime.memory import sample as sample_memory


__all__ = ["ScaledOptimizer", "update_task", "check_per_stage", "sumsq_task", "norm_task"]

# jitted optimizer steps per (trainer, replica count), kept on each worker: the optimizer
# arrives pickled with every task (optax transforms are closures, re-created on each
# unpickling), so a cache keyed by the object would compile on every step
_COMPILED_UPDATES: dict[str, Any] = {}
_UPDATES_LOCK = threading.Lock()


class ScaledOptimizer:
    """An optax transform applied to the replica-summed gradients divided by r; `key`
    names it stably across tasks (the trainer and r) for the workers' jit cache."""

    def __init__(self, optimizer: optax.GradientTransformation, r: int, key: str = "",
                 clip: float | None = None) -> None:
        self.optimizer, self.r, self.key, self.clip = optimizer, r, key, clip

    def __reduce__(self) -> tuple[Any, ...]:
        # by value, as bytes made once (`core.byvalue`): an optax transform is a set of
        # closures that plain pickle refuses, so each step's whole graph fell back to
        # cloudpickle after a failed plain-pickle attempt
        return (_revive, payload(self, (id(self.optimizer), self.r, self.key, self.clip),
                                 lambda: (self.optimizer, self.r, self.key, self.clip)))

    def update(self, grads: Any, state: Any, params: Any, norm: Any = None) -> Any:
        if self.r > 1:
            grads = [g / self.r for g in grads]
        if self.clip is not None and norm is not None:
            # optax.clip_by_global_norm's arithmetic, with the norm of every stage's
            # gradients (`norm_task`)
            keep = jnp.squeeze(norm < self.clip)
            grads = [jax.lax.select(keep, g, (g / norm.astype(g.dtype)) * self.clip)
                     for g in grads]
        return self.optimizer.update(grads, state, params)

    def step(self, params: Any, state: Any, grads: Any, norm: Any = None
             ) -> tuple[Any, Any]:
        updates, new_state = self.update(grads, state, params, norm)
        return optax.apply_updates(params, updates), new_state

    def compiled(self) -> Any:
        """The jitted `step`, compiled once per worker process and key."""
        if not self.key:
            return jax.jit(self.step)
        fn = _COMPILED_UPDATES.get(self.key)
        if fn is None:
            with _UPDATES_LOCK:
                fn = _COMPILED_UPDATES.setdefault(self.key, jax.jit(self.step))
        return fn


def _revive(digest: str, data: bytes) -> ScaledOptimizer:
    return revive(digest, data, lambda st: ScaledOptimizer(*st),
                  lambda o: (id(o.optimizer), o.r, o.key, o.clip))


@jax.jit
def _sumsq(grads: list[Any], r: float) -> Any:
    return sum(jnp.sum(jnp.square(jnp.abs(g / r).astype(jnp.float32))) for g in grads)


def sumsq_task(r: int, *grads: Any) -> Any:
    """The sum of squares of one stage's gradient leaves (summed over `r` replicas: of
    their mean), for the global norm (`norm_task`)."""
    return _sumsq(list(grads), float(r))


def norm_task(*sumsqs: Any) -> Any:
    """The global norm of every stage's gradients, from each stage's `sumsq_task`."""
    return jnp.sqrt(sum(jnp.asarray(s) for s in sumsqs))


def update_task(optimizer: ScaledOptimizer, n: int, state: Any, *grads: Any,
                norm: Any = None, **after: Any) -> tuple:
    """One optax step for one stage's parameter leaves: (new leaves..., new opt state);
    `norm`: the global norm of every stage's gradients, for the Trainer's
    ``clip_global_norm``."""
    params, opt_state = list(state[:n]), state[n]
    new, new_state = optimizer.compiled()(params, opt_state, list(grads), norm)
    out = (*jax.block_until_ready(new), new_state)
    sample_memory()          # old and new state both held: a stage's high point
    return out


#: gradient scales the per-stage check tries: a global-norm clip at any threshold in
#: between is active at one of them (a stand-in leaf has at most 3 entries a dimension)
_CHECK_SCALES = (1.0, 1e8)


def check_per_stage(optimizer: Any, leaves: Sequence[Any], groups: Sequence[Sequence[int]],
                    stages: Sequence[int], compare: bool = True, treedef: Any = None) -> None:
    """Raise `OptimizerError` when `optimizer` applied to each group's parameter leaves
    alone (as a Trainer applies it: a list of the stage's leaves, on the stage's worker)
    gives other updates than applied to all `leaves` at once, over two steps with
    gradients at two scales (1, and 1e8: every global-norm clip active), and with a NaN
    in one gradient of the last stage (optax.apply_if_finite skips every update). Run on small
    stand-ins of the leaves (each dimension cut to 3, float32, fixed random values), on
    the CPU: it checks the optimizer's math, not the model's sizes. First (and alone with
    ``compare=False``) the optimizer is evaluated abstractly on the real shapes as a list
    of leaves: one that fails there (keyed on the parameters' tree) raises too. With the
    parameters' `treedef`, the optimizer applied to the list of leaves must also give the
    updates it gives on the tree itself (a mask or label function reading the tree's
    paths or dict keys sees none in a list, and would apply to every leaf alike)."""
    avals = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
    try:                # the real shapes, abstractly: what every stage's update will do
        jax.eval_shape(lambda p: optimizer.update(p, optimizer.init(p), p), avals)
    except Exception as e:                    # noqa: BLE001 - re-raised with the facts
        extra = _extra_update_args(e)
        if extra:
            raise OptimizerError(
                f"dd.Trainer: the optimizer's update needs the extra argument(s) "
                f"{', '.join(map(repr, extra))} ({str(e)[:200]}): an optax "
                "GradientTransformationExtraArgs such as optax.contrib.reduce_on_plateau "
                "(value=), optax.lbfgs (value=, grad=, value_fn=) or optax.polyak_sgd "
                "(value=). dd.Trainer calls update(grads, opt_state, params) on each "
                "stage's worker, with nothing else. Fix: an optimizer whose update needs "
                "only those, e.g. a learning-rate schedule (optax.schedules) in place of "
                "reduce_on_plateau, or optax.adam in place of a line search") from e
        raise OptimizerError(
            f"dd.Trainer: the optimizer fails on the model's parameters given as a list of "
            f"their leaves ({type(e).__name__}: {str(e)[:300]}), which is how dagdiff "
            "applies it, to each stage's leaves on the stage's worker. A transform keyed "
            "on the parameters' tree (optax.multi_transform or optax.masked with a label "
            "or mask tree, or a function that reads dict keys) cannot run there: give "
            "every parameter one optimizer, or a mask function of each leaf alone (e.g. "
            "lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p))") from e
    rng = np.random.default_rng(0)
    cpu = jax.devices("cpu")[0]
    if treedef is not None and treedef.num_leaves == len(leaves) and len(leaves) > 1:
        _check_tree(optimizer, leaves, treedef, rng, cpu)
    if len(groups) < 2 or not compare:
        return

    def stand_in(x: Any) -> Any:
        return _stand_in(x, rng)

    with jax.default_device(cpu):
        params = [stand_in(x) for x in leaves]
        base = [(stand_in(x), stand_in(x)) for x in leaves]
        trials = [(f"gradients of scale {scale:g}", [(a * scale, b * scale) for a, b in base])
                  for scale in _CHECK_SCALES]
        # a non-finite gradient on the last stage alone (in its first step): a transform
        # that skips or zeroes every update then (optax.apply_if_finite) reads them all
        poisoned = list(base)
        first = groups[-1][0]
        a, b = poisoned[first]
        if a.size:
            poisoned[first] = (a.reshape(-1).at[0].set(jnp.nan).reshape(a.shape), b)
            trials.append((f"a NaN in one gradient of stage {stages[-1]} only", poisoned))
        for what, grads in trials:
            try:
                whole = _checked_steps(optimizer, params, grads)
            except Exception:                 # noqa: BLE001 - the real run will say
                return
            parts: list[Any] = [None] * len(leaves)
            for group, stage in zip(groups, stages):
                try:
                    got = _checked_steps(optimizer, [params[i] for i in group],
                                         [grads[i] for i in group])
                except Exception as e:        # noqa: BLE001 - re-raised with the facts
                    raise OptimizerError(
                        f"dd.Trainer: the optimizer runs on the whole model's parameters "
                        f"but fails on stage {stage}'s alone ({type(e).__name__}: "
                        f"{str(e)[:300]}); dagdiff applies it to each stage's parameters, "
                        "as a list of that stage's leaves, on the stage's worker. A mask or "
                        "label pytree of the whole model (optax.masked, "
                        "optax.multi_transform) does not fit such a list: use one "
                        "optimizer for every parameter, or a model on one stage") from e
                for i, u in zip(group, got):
                    parts[i] = u
            top = max(float(np.nanmax(np.abs(u))) if np.isfinite(u).any() else 0.0
                      for u in whole) or 1.0
            for group, stage in zip(groups, stages):
                for i in group:
                    if not np.allclose(parts[i], whole[i], rtol=1e-4, atol=1e-5 * top,
                                       equal_nan=True):
                        raise OptimizerError(
                            f"dd.Trainer: the optimizer couples the parameters of different "
                            f"stages: applied to stage {stage}'s parameters alone (as dagdiff "
                            f"applies it, on the stage's worker) its update of parameter "
                            f"leaf {i} (shape {tuple(np.shape(leaves[i]))}) differs from "
                            f"its update of the whole model, with {what}. A transform that reads every gradient does this "
                            "(optax.clip_by_global_norm, optax.apply_if_finite, noise drawn "
                            "for the whole tree). Fix: for a global-norm clip, drop it from "
                            "the optimizer and pass dd.Trainer(..., clip_global_norm=c) (the "
                            "norm of every stage's gradients, as optax computes it); or clip "
                            "each leaf (optax.clip, optax.adaptive_grad_clip); or pass "
                            "per_stage_optimizer=True to apply it to each stage's "
                            "parameters alone (a global-norm clip then clips each stage's "
                            "gradients by their own norm)")


def _check_tree(optimizer: Any, leaves: Sequence[Any], treedef: Any,
                rng: np.random.Generator, cpu: Any) -> None:
    """Raise `OptimizerError` when `optimizer` gives the list of `leaves` other updates
    than the pytree of them (`treedef`), on small stand-ins (see `check_per_stage`)."""
    with jax.default_device(cpu):
        params = [_stand_in(x, rng) for x in leaves]
        grads = [(_stand_in(p, rng), _stand_in(p, rng)) for p in params]
        try:
            as_list = _checked_steps(optimizer, params, grads)
            as_tree = _checked_steps(optimizer, params, grads, treedef)
        except Exception:                     # noqa: BLE001 - the real run will say
            return
    for i, (a, b) in enumerate(zip(as_list, as_tree)):
        if not np.allclose(a, b, rtol=1e-4, atol=1e-6, equal_nan=True):
            path = jax.tree_util.keystr(
                jax.tree_util.tree_flatten_with_path(
                    jax.tree_util.tree_unflatten(treedef, list(range(len(leaves)))))[0][i][0])
            raise OptimizerError(
                f"dd.Trainer: the optimizer treats the parameters by their place in the "
                f"tree: its update of parameter leaf {i} ({path}, shape "
                f"{tuple(np.shape(leaves[i]))}) differs between the parameters' pytree and "
                "a list of their leaves, which is how dagdiff applies it (each stage's "
                "leaves on the stage's worker), where it would see no paths or dict keys. "
                "A mask or label function that reads them does this (optax.adamw(..., "
                "mask=...) or optax.masked / optax.multi_transform with a function of the "
                "paths). Fix: a mask of each leaf alone, e.g. mask=lambda p: jax.tree_util."
                "tree_map(lambda x: x.ndim > 1, p) to decay weight matrices and not biases")


def _stand_in(x: Any, rng: np.random.Generator) -> Any:
    """A small float32 stand-in of array `x` (each dimension cut to 3), random values."""
    return jnp.asarray(rng.standard_normal(tuple(min(int(d), 3) for d in np.shape(x))),
                       np.float32)


def _extra_update_args(error: BaseException) -> list[str]:
    """The keyword-only arguments an optimizer's update said it misses (`error`: what
    calling it with (updates, state, params) raised), or []."""
    text = str(error)
    if not isinstance(error, TypeError) or "required keyword-only argument" not in text:
        return []
    return re.findall(r"'(\w+)'", text.split("argument", 1)[1])


def _checked_steps(optimizer: Any, params: list[Any], grads: list[tuple[Any, Any]],
                   treedef: Any = None) -> list[np.ndarray]:
    """`_two_steps`, jitted (one compilation per list of shapes: eager, an optimizer
    with conditions took seconds), as NumPy arrays."""
    return [np.asarray(u, np.float64)
            for u in _two_steps_jit(optimizer, params, grads, treedef)]


def _two_steps(optimizer: Any, params: list[Any], grads: list[tuple[Any, Any]],
               treedef: Any = None) -> list[Any]:
    """The updates of two optimizer steps from `optimizer.init(params)` (`grads`: each
    leaf's gradients of the two steps, independent: a scale-free optimizer such as adam
    after a global-norm clip differs only when the norms' ratio between steps differs
    between stages), per leaf as one NumPy array. The optimizer sees the leaves as a
    list, or with `treedef` as that pytree of them."""
    def tree(xs: list[Any]) -> Any:
        return xs if treedef is None else jax.tree_util.tree_unflatten(treedef, xs)

    p = tree(list(params))
    state = optimizer.init(p)
    first, state = optimizer.update(tree([a for a, _ in grads]), state, p)
    moved = optax.apply_updates(p, first)
    second, _ = optimizer.update(tree([b for _, b in grads]), state, moved)
    return [jnp.concatenate([jnp.ravel(a), jnp.ravel(b)]) for a, b in
            zip(jax.tree_util.tree_leaves(first), jax.tree_util.tree_leaves(second))]


_two_steps_jit = jax.jit(_two_steps, static_argnums=(0, 3))
