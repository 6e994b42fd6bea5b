"""What runs inside the tasks: forward (value + pullback), VJP, sums, slices."""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..core.custom import check_cotangents, fwd_result
from ..core.spec import CallSpec
from .compiled import compiled, note_remat, track_live
from .memory import sample as sample_memory
from .taskspec import Task, TaskRef


__all__ = ["FwdResult", "fwd_task", "vjp_task", "sum_task", "slice_task", "mean_task",
           "acc_task", "select_task", "leaves_read", "host_view", "snapshot", "snapshot_batch",
           "pullback_of"]


class FwdResult:
    """Value of a forward task: output leaves and the pullback (None when rematerialized),
    or, for a forward fused with its backward (`fwd_task`'s ``seed``), the cotangents of
    its differentiated inputs.

    Pickling keeps the outputs only: a consumer on another worker needs just those,
    and a VJP task that receives a copy rebuilds the pullback from its primals.
    """

    __slots__ = ("out", "pullback", "moved", "tag", "res", "grads", "carry")

    def __init__(self, out: list[Any], pullback: Any, moved: bool = False,
                 tag: tuple[Any, Any] | None = None, res: Any = None,
                 grads: tuple[Any, ...] | None = None) -> None:
        self.out = out
        self.pullback = pullback
        self.moved = moved
        self.tag = tag
        self.res = res          # residuals of a custom rule: plain arrays, they travel
        self.grads = grads      # input cotangents computed with the forward (stay here)
        #: what a split backward's W still needs, left by its I (or by a forward that
        #: ran with its I): (W's `wrt`, the `SplitBackward`, its stash); stays here
        self.carry: tuple[tuple[int, ...], Any, tuple[Any, ...]] | None = None

    def __reduce__(self) -> Any:
        return (_arrived, (self.out, self.res))

    def nbytes(self) -> int:
        leaves = jax.tree_util.tree_leaves((self.out, self.pullback, self.res, self.grads,
                                            self.carry))
        return int(sum(getattr(x, "nbytes", 0) for x in leaves))

    def __repr__(self) -> str:
        state = "moved" if self.moved else ("pullback" if self.pullback is not None else
                                            "gradients" if self.grads is not None else "primal")
        return f"FwdResult({len(self.out)} outputs, {state})"


def snapshot(x: Any) -> Any:
    """What a graph embeds of an input value (`host_view`), with a writeable NumPy array
    copied: the graph reaches the workers after the call returns, and a data loader that
    fills one buffer in place for every batch would otherwise train on a later batch's
    rows (as `jax.device_put` does, the value is the one at the call)."""
    v = host_view(x)
    return _frozen_copy(v) if isinstance(v, np.ndarray) and v.flags.writeable else v


def _frozen_copy(x: np.ndarray) -> np.ndarray:
    """A read-only copy: a later `snapshot` of it (the step `fit` or `Trainer.step` took
    it for, then its graph) copies no more."""
    out = x.copy()
    out.flags.writeable = False
    return out


def snapshot_batch(batch: Sequence[Any]) -> tuple[Any, ...]:
    """A batch's arguments with every writeable NumPy array in them copied (`snapshot`):
    what a step and its lineage (the steps recovery runs again) keep of it."""
    return tuple(jax.tree_util.tree_map(
        lambda x: _frozen_copy(x) if isinstance(x, np.ndarray) and x.flags.writeable else x,
        b) for b in batch)


def _arrived(out: list[Any], res: Any = None) -> FwdResult:
    return FwdResult(out, None, moved=True, res=res)


def host_view(x: Any) -> Any:
    """What a graph embeds of an input value: a CPU jax array as its NumPy view (no copy),
    which pickle sends as an out-of-band buffer and which no process on its way (the
    scheduler) rebuilds as a jax array; anything else (GPU arrays too) as it is."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        try:
            if all(d.platform == "cpu" for d in x.devices()):
                return np.asarray(x)
        except Exception:                      # noqa: BLE001 - deleted or abstract arrays
            return x
    return x


def _take(value: Any, src: int) -> Any:
    """A dependency's value: leaf `src` of a FwdResult/tuple, or the value itself (src < 0)."""
    if src < 0:
        return value
    if isinstance(value, FwdResult):
        return value.out[src]
    return value[src]


def _device(dev: int | None) -> Any:
    return None if dev is None else jax.local_devices()[dev % len(jax.local_devices())]


def _put(x: Any, device: Any) -> Any:
    """Move an array to `device` (no-op when already there or when device is None)."""
    if device is None or not isinstance(x, (jax.Array, np.ndarray)):
        return x
    if isinstance(x, jax.Array) and x.devices() == {device}:
        return x
    return jax.device_put(x, device)


def _split(spec: CallSpec, srcs: tuple[int, ...], vals: Sequence[Any],
           device: Any = None) -> tuple[list[Any], list[Any]]:
    d, nd = [], []
    for f, s, v in zip(spec.diff, srcs, vals):
        (d if f else nd).append(_put(_take(v, s), device))
    return d, nd


def fwd_task(spec: CallSpec, srcs: tuple[int, ...], dev: int | None, *vals: Any,
             tag: tuple[Any, Any] | None = None, vjp: bool = True,
             seed: tuple[Any, ...] | None = None,
             split: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
             **after: Any) -> FwdResult:
    """Forward of one layer call: outputs plus the pullback (kept in this process).

    `dev`: local JAX device index (single-process stage pinning). `tag`: (stage,
    microbatch) for the live-pullback count. `vjp=False`: no VJP task will ask for a
    pullback (the call does not reach the loss). `seed`: the call's output cotangents
    are these constants (the loss's seed, None for outputs without one), and its VJP
    runs right after it: forward and backward run as one jitted call (one fused
    ``value_and_grad``, no residuals kept) and the VJP task only hands the cotangents
    on. `split` = (I's `wrt`, W's `wrt`) with a seed: the backward is split (a
    zero-bubble schedule) and only its I part runs with the forward; W's task runs the
    rest later from what this one leaves (`dagdiff.core.split`). `after`:
    ordering-only dependencies.
    """
    try:
        if getattr(spec.layer, "custom", False):
            return _custom_fwd(spec, srcs, vals, _device(dev), tag)
        c = compiled(spec)
        d, nd = _split(spec, srcs, vals, _device(dev))
        if spec.remat or not d or not vjp:
            res = FwdResult(jax.block_until_ready(c.forward(d, nd)), None, tag=tag)
            sample_memory()
            return res
        if seed is not None:
            parts = c.fwd_grad_split(d, nd, list(seed), *split) if split else None
            if parts is not None:
                out, head, rest, stash = jax.block_until_ready(parts)
                grads: list[Any] = [None] * len(d)
                for i, g in zip(split[0], head):
                    grads[i] = g
                res = FwdResult(out, None, tag=tag, grads=tuple(grads))
                res.carry = (split[1], rest, stash)
            else:
                out, every = jax.block_until_ready(c.fwd_grad(d, nd, list(seed)))
                res = FwdResult(out, None, tag=tag, grads=every)
            track_live(tag, +1)
            sample_memory()
            return res
        out, pb = jax.block_until_ready(c.fwd_vjp(d, nd))   # the task ends when its work does
    except Exception as e:
        _note(e, "forward", spec, tag, vals)
        raise
    track_live(tag, +1)
    res = FwdResult(out, pb, tag=tag)
    sample_memory()
    return res


def _note(error: BaseException, what: str, spec: CallSpec, tag: Any, vals: Sequence[Any]) -> None:
    """Say on a failing task's error which layer call it was (once): the user's traceback
    otherwise ends in their layer's code with no stage or microbatch."""
    if any(str(n).startswith("dagdiff: in the ") for n in getattr(error, "__notes__", ())):
        return
    where = ""
    if isinstance(tag, tuple) and len(tag) == 2:
        where = f" (stage {tag[0]}, microbatch {tag[1]})"
    leaves = [x for v in vals for x in (v.out if isinstance(v, FwdResult) else [v])]
    shapes = [f"{np.dtype(v.dtype).name}{list(v.shape)}" for v in leaves
              if hasattr(v, "shape") and hasattr(v, "dtype")][:6]
    note = f"dagdiff: in the {what} of layer {spec.name!r}{where}"
    if shapes:
        note += f", array inputs {', '.join(shapes)}"
    unknown = [c.hint for c in getattr(spec, "pytree_classes", ()) if c.kind == "unknown"]
    if unknown:
        note += "; " + "; ".join(unknown)
    try:
        error.add_note(note)
    except Exception:                          # Python < 3.11, or a frozen exception
        pass


def vjp_task(spec: CallSpec, srcs: tuple[int, ...], wrt: tuple[int, ...],
             ct_srcs: tuple[int | None, ...], dev: int | None, fwd: FwdResult,
             *vals: Any, release: bool = False, then: tuple[int, ...] = (),
             **after: Any) -> tuple[Any, ...]:
    """VJP of one layer call w.r.t. differentiated leaves `wrt` (indices among them).

    `vals` holds the output cotangents (one per non-None entry of `ct_srcs`) followed
    by the primal inputs, which are only read to rebuild a pullback that moved.
    `release`: this is the call's last backward task, so its pullback is dropped after.
    `then`: the `wrt` of the task that follows it (a split backward's W after this I):
    this task also leaves on `fwd` what W needs to skip the work they share.
    """
    try:
        if getattr(spec.layer, "custom", False):
            return _custom_vjp(spec, srcs, wrt, ct_srcs, dev, fwd, vals)
        out = jax.block_until_ready(_vjp(spec, srcs, wrt, ct_srcs, dev, fwd, vals, then))
    except Exception as e:
        _note(e, "VJP", spec, getattr(fwd, "tag", None), vals)
        raise
    sample_memory()
    if release:
        fwd.carry = None
        if fwd.pullback is not None or fwd.grads is not None:
            fwd.pullback = fwd.grads = None
            track_live(fwd.tag, -1)
    return out


def pullback_of(task: Any) -> str | None:
    """The key of the forward task whose result a backward task reads its pullback from
    (a `vjp_task`'s `fwd` argument), None for any other task: dagdiff's scheduler plugin
    runs the two on one worker (pullbacks cannot travel)."""
    if isinstance(task, Task) and task.func is vjp_task:
        ref = task.args[5]
        return str(ref.key) if isinstance(ref, TaskRef) else None
    return None


def _vjp(spec: CallSpec, srcs: tuple[int, ...], wrt: tuple[int, ...],
         ct_srcs: tuple[int | None, ...], dev: int | None, fwd: FwdResult,
         vals: Sequence[Any], then: tuple[int, ...] = ()) -> tuple[Any, ...]:
    n_ct = sum(s is not None for s in ct_srcs)
    device = _device(dev)
    it = iter(vals[:n_ct])
    cts = [None if s is None else _put(_take(next(it), s), device) for s in ct_srcs]
    if fwd.carry is not None and fwd.carry[0] == wrt:   # a split backward's W, after its I
        _, rest, stash = fwd.carry
        return rest.run_second(stash)
    if fwd.grads is not None:             # computed with the forward (`fwd_task`'s seed)
        return tuple(_put(fwd.grads[i], device) for i in wrt)
    c = compiled(spec)
    pb = fwd.pullback
    if pb is not None:
        if then:
            split = c.split_bwd(pb, cts, wrt, then)
            if split is not None:
                grads, rest, stash = split
                if fwd.pullback is not None:   # not released meanwhile (threads)
                    fwd.carry = (then, rest, stash)
                return grads
        return c.bwd(pb, cts, wrt)
    if not spec.remat:
        note_remat()
    d, nd = _split(spec, srcs, vals[n_ct:], device)
    return c.remat_bwd(d, nd, cts, wrt)


def _dyn_args(spec: CallSpec, srcs: tuple[int, ...], vals: Sequence[Any],
              device: Any) -> list[Any]:
    return [_put(_take(v, s), device) for s, v in zip(srcs, vals)]


def _call_rule(spec: CallSpec, rule: Any, dyn: Sequence[Any], *extra: Any) -> Any:
    it = iter(dyn)
    leaves = [next(it) if k == "d" else s for k, s in zip(spec.kinds, spec.statics)]
    args, kwargs = jax.tree_util.tree_unflatten(spec.in_treedef, leaves)
    return rule(*extra, *args, **kwargs)


def _custom_fwd(spec: CallSpec, srcs: tuple[int, ...], vals: Sequence[Any], device: Any,
                tag: Any) -> FwdResult:
    out, res = fwd_result(_call_rule(spec, spec.layer.fwd_rule,
                                     _dyn_args(spec, srcs, vals, device)), spec.name)
    leaves, tree = jax.tree_util.tree_flatten(out)
    # the residuals travel with the output's structure (leaves as 0), which the bwd
    # rule's cotangent takes: a rule returning ``(y, (a, b))`` or a dict gets its
    # cotangent in that form, as `jax.custom_vjp` gives it
    return FwdResult(leaves, None, tag=tag,
                     res=_CustomRes(res, jax.tree_util.tree_unflatten(tree, [0] * len(leaves))))


class _CustomRes(NamedTuple):
    """What a custom rule's forward task keeps for its VJP task: the rule's residuals and
    a template of its output's structure (leaves 0)."""

    res: Any
    template: Any


def _custom_vjp(spec: CallSpec, srcs: tuple[int, ...], wrt: tuple[int, ...],
                ct_srcs: tuple[int | None, ...], dev: int | None, fwd: FwdResult,
                vals: Sequence[Any]) -> tuple[Any, ...]:
    n_ct = sum(s is not None for s in ct_srcs)
    it = iter(vals[:n_ct])
    cts = []
    for s, a in zip(ct_srcs, spec.out_avals):
        cts.append(np.zeros(a.shape, a.dtype) if s is None else _take(next(it), s))
    res, template = fwd.res
    ct = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), cts)
    primals = _dyn_args(spec, srcs, vals[n_ct:], _device(dev))
    got = check_cotangents(spec.layer, spec.layer.bwd_rule(res, ct), primals, spec.diff)
    return tuple(got[i] for i in wrt)


def sum_task(srcs: tuple[int, ...], zeros: Any, dev: int | None, *vals: Any,
             **after: Any) -> Any:
    """Sum cotangent contributions (each a leaf of a VJP result); `zeros` when there are none."""
    device = _device(dev)
    parts = [_put(_take(v, s), device) for v, s in zip(vals, srcs)]
    if not parts:
        shape, dtype = zeros
        return _put(jnp.zeros(shape, dtype), device)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    sample_memory()
    return total


def slice_task(axis: int, mb: int, m: int, value: Any, src: int = -1) -> Any:
    """Microbatch `mb` of `m` equal parts of `value` (leaf `src` of it) along `axis`."""
    value = _take(value, src)
    size = value.shape[axis] // m
    index = [slice(None)] * value.ndim
    index[axis] = slice(mb * size, (mb + 1) * size)
    return value[tuple(index)]


def mean_task(*values: Any) -> Any:
    """Mean of the microbatch losses."""
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total / len(values)


def acc_task(layout: tuple[Any, ...], dev: int | None, prev: Any, *vals: Any,
             **after: Any) -> tuple[Any, ...]:
    """Gradient accumulator of one stage and microbatch: for each parameter leaf, the sum
    of its contributions (entries of `vals`) plus its sum from the previous microbatch.
    The leaves with more than one part are summed in one jitted call (one dispatch for
    the stage, not one per leaf and part: on a worker each dispatch is a chance to lose
    the GIL to the event loop, which a step's hops wait on)."""
    device = _device(dev)
    out: list[Any] = []
    groups: list[tuple[Any, ...]] = []
    where: list[int] = []
    for i, (entries, zeros) in enumerate(layout):
        parts = [_put(_take(vals[j], s), device) for j, s in entries]
        if prev is not None:
            parts.append(prev[i])
        if not parts:
            shape, dtype = zeros
            out.append(_put(jnp.zeros(shape, dtype), device))
        elif len(parts) == 1:
            out.append(parts[0])
        elif all(_summable(p) for p in parts):
            out.append(None)
            groups.append(tuple(parts))
            where.append(i)
        else:
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            out.append(total)
    if groups:
        for i, total in zip(where, _sum_groups(tuple(groups))):
            out[i] = total
    sample_memory()
    return tuple(out)


def _summable(x: Any) -> bool:
    """Whether `x` goes through `_sum_groups`: an array of a floating or complex dtype."""
    if not isinstance(x, (jax.Array, np.ndarray)):
        return False
    inexact = _INEXACT.get(x.dtype)
    if inexact is None:
        inexact = _INEXACT[x.dtype] = bool(jnp.issubdtype(x.dtype, jnp.inexact))
    return inexact


_INEXACT: dict[Any, bool] = {}


@jax.jit
def _sum_groups(groups: tuple[tuple[Any, ...], ...]) -> tuple[Any, ...]:
    """Per group, the sum of its arrays (traced once per structure, shapes and dtypes)."""
    out = []
    for parts in groups:
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        out.append(total)
    return tuple(out)


def select_task(src: int, value: Any) -> Any:
    """One leaf of a forward result (the loss, an aux output)."""
    return _take(value, src)


def leaves_read(task: Any) -> dict[str, frozenset[int] | None]:
    """Which leaves of each dependency a task reads: leaf indices of a tuple or
    `FwdResult` value, or None for the whole value. Direct dispatch sends another
    worker only those (a VJP result holds the weight gradients, which stay on the
    stage, next to the input cotangent the previous stage needs)."""
    reads: dict[str, set[int] | None] = {}

    def read(ref: Any, src: int | None) -> None:
        if not isinstance(ref, TaskRef):
            return
        if src is None or src < 0:
            reads[ref.key] = None
        elif ref.key not in reads or reads[ref.key] is not None:
            reads.setdefault(ref.key, set()).add(src)  # type: ignore[union-attr]

    f, a, kw = task.func, list(task.args), dict(task.kwargs)
    known = True
    if f is fwd_task:
        srcs, vals = a[1], a[3:]
        for s, v in zip(srcs, vals):
            read(v, s)
    elif f is vjp_task:
        srcs, ct_srcs, fwd, vals = a[1], a[3], a[5], a[6:]
        read(fwd, None)
        for s, v in zip([c for c in ct_srcs if c is not None] + list(srcs), vals):
            read(v, s)
    elif f is sum_task:
        for s, v in zip(a[0], a[3:]):
            read(v, s)
    elif f is acc_task:
        layout, vals = a[0], a[3:]
        read(a[2], None)
        for entries, _ in layout:
            for j, s in entries:
                read(vals[j], s)
    elif f is select_task:
        read(a[1], a[0])
    elif f is slice_task:
        read(a[3], a[4] if len(a) > 4 else kw.get("src", -1))
    else:
        known = False
    for v in list(a) + list(kw.values()):
        if isinstance(v, TaskRef) and (not known or v.key not in reads):
            read(v, None)       # anything else (ordering edges, unknown tasks): whole
    return {k: (None if v is None else frozenset(v)) for k, v in reads.items()}
