"""What runs inside the tasks: forward (value + pullback), VJP, sums; worker-side jit caches.

Pullbacks from `jax.vjp` cannot be pickled. A `FwdResult` that leaves its process
travels as its outputs alone; the VJP task then rebuilds the pullback from the primal
inputs it also depends on (rematerialization) and counts the event (`remat_count`).
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "CallSpec",
    "make_call_spec",
    "FwdResult",
    "fwd_task",
    "vjp_task",
    "sum_task",
    "select_task",
    "leaves_read",
    "slice_task",
    "mean_task",
    "acc_task",
    "remat_count",
    "reset_remat_count",
    "compile_count",
    "peak_live",
    "reset_peak_live",
]


@dataclass(frozen=True, eq=False)
class CallSpec:
    """Everything a worker needs to run one layer signature: function, argument layout,
    which dynamic leaves are differentiated, output avals, and a stable fingerprint."""

    layer: Any
    name: str
    fingerprint: str
    in_template: Any                # the arguments' pytree with `_LEAF` at every leaf
    kinds: tuple[str, ...]          # per argument leaf: "d" dynamic array, "s" static
    statics: tuple[Any, ...]        # static leaf values (None where dynamic)
    diff: tuple[bool, ...]          # per dynamic leaf: differentiated?
    out_avals: tuple[jax.ShapeDtypeStruct, ...] = ()
    remat: bool = False

    @property
    def in_treedef(self) -> Any:
        """The arguments' treedef, rebuilt from `in_template` once per process: treedefs of
        some libraries' pytrees (equinox) do not survive pickling, their objects do."""
        td = self.__dict__.get("_treedef")
        if td is None:
            td = jax.tree_util.tree_structure(self.in_template)
            object.__setattr__(self, "_treedef", td)
        return td

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_treedef"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)

    def call(self, dyn: Sequence[Any]) -> Any:
        """Run the layer function on dynamic leaves `dyn` (statics filled in)."""
        it = iter(dyn)
        leaves = [next(it) if k == "d" else s for k, s in zip(self.kinds, self.statics)]
        args, kwargs = jax.tree_util.tree_unflatten(self.in_treedef, leaves)
        return self.layer.fn(*args, **kwargs)

    def with_outputs(self, out_avals: tuple[jax.ShapeDtypeStruct, ...]) -> "CallSpec":
        """This spec with its output avals, which are part of the fingerprint."""
        from dask.base import tokenize

        sig = tuple((a.shape, str(a.dtype)) for a in out_avals)
        new = dataclasses.replace(self, out_avals=out_avals,
                                  fingerprint=f"{self.fingerprint}-{tokenize(sig)[:8]}")
        object.__setattr__(new, "_treedef", self.__dict__.get("_treedef"))
        return new

    @property
    def n_diff(self) -> int:
        return sum(self.diff)


def make_call_spec(layer: Any, treedef: Any, kinds: tuple[str, ...], statics: tuple[Any, ...],
                   diff: tuple[bool, ...]) -> CallSpec:
    """Build a `CallSpec`, fingerprinting function, layout and statics once."""
    from dask.base import tokenize

    fp = tokenize(layer.fingerprint, str(treedef), kinds, statics, diff,
                  ensure_deterministic=False)
    template = jax.tree_util.tree_unflatten(treedef, [_LEAF] * treedef.num_leaves)
    spec = CallSpec(layer, layer.name, f"{layer.name}-{fp}", template, kinds, statics, diff,
                    remat=layer.remat)
    object.__setattr__(spec, "_treedef", treedef)
    return spec


class _Leaf:
    """Placeholder leaf of `CallSpec.in_template`."""

    def __repr__(self) -> str:
        return "*"


_LEAF = _Leaf()


class _Compiled:
    """The jitted functions of one CallSpec (forward, forward+vjp, backward, remat backward)."""

    def __init__(self, spec: CallSpec) -> None:
        diff = spec.diff
        out_avals = spec.out_avals

        def merge(d: Sequence[Any], nd: Sequence[Any]) -> list[Any]:
            di, ni = iter(d), iter(nd)
            return [next(di) if f else next(ni) for f in diff]

        def primal(d: Sequence[Any], nd: Sequence[Any]) -> list[Any]:
            return jax.tree_util.tree_leaves(spec.call(merge(d, nd)))

        def fwd_vjp(d: Sequence[Any], nd: Sequence[Any]) -> Any:
            return jax.vjp(lambda *dd: primal(dd, nd), *d)

        def full_ct(cts: Sequence[Any]) -> list[Any]:
            out = []
            for c, a in zip(cts, out_avals):
                if c is not None:
                    out.append(c.astype(a.dtype) if c.dtype != a.dtype else c)
                elif jax.dtypes.issubdtype(a.dtype, np.inexact):
                    out.append(jnp.zeros(a.shape, a.dtype))
                else:
                    out.append(np.zeros(a.shape, jax.dtypes.float0))
            return out

        def bwd(pb: Any, cts: Sequence[Any], wrt: tuple[int, ...]) -> tuple[Any, ...]:
            g = pb(full_ct(cts))
            return tuple(g[i] for i in wrt)

        def remat_bwd(d: Sequence[Any], nd: Sequence[Any], cts: Sequence[Any],
                      wrt: tuple[int, ...]) -> tuple[Any, ...]:
            _, pb = fwd_vjp(d, nd)
            return bwd(pb, cts, wrt)

        self.forward = jax.jit(primal)
        self.fwd_vjp = jax.jit(fwd_vjp)
        self.bwd = jax.jit(bwd, static_argnums=2)
        self.remat_bwd = jax.jit(remat_bwd, static_argnums=3)


_CACHE: dict[str, _Compiled] = {}
_LOCK = threading.Lock()
_COUNTS = {"remat": 0, "compile": 0}


def _compiled(spec: CallSpec) -> _Compiled:
    c = _CACHE.get(spec.fingerprint)
    if c is None:
        with _LOCK:
            c = _CACHE.get(spec.fingerprint)
            if c is None:
                c = _CACHE[spec.fingerprint] = _Compiled(spec)
                _COUNTS["compile"] += 1
    return c


def remat_count() -> int:
    """Pullbacks rebuilt in this process because they had left the process of their forward."""
    return _COUNTS["remat"]


def reset_remat_count() -> None:
    _COUNTS["remat"] = 0


def compile_count() -> int:
    """Layer signatures compiled in this process (one per worker and signature, not per task)."""
    return _COUNTS["compile"]


class FwdResult:
    """Value of a forward task: output leaves and the pullback (None when rematerialized).

    Pickling keeps the outputs only: a consumer on another worker needs just those,
    and a VJP task that receives a copy rebuilds the pullback from its primals.
    """

    __slots__ = ("out", "pullback", "moved", "tag", "res")

    def __init__(self, out: list[Any], pullback: Any, moved: bool = False,
                 tag: tuple[Any, Any] | None = None, res: Any = None) -> None:
        self.out = out
        self.pullback = pullback
        self.moved = moved
        self.tag = tag
        self.res = res          # residuals of a custom rule: plain arrays, they travel

    def __reduce__(self) -> Any:
        return (_arrived, (self.out, self.res))

    def nbytes(self) -> int:
        leaves = jax.tree_util.tree_leaves((self.out, self.pullback, self.res))
        return int(sum(getattr(x, "nbytes", 0) for x in leaves))

    def __repr__(self) -> str:
        state = "moved" if self.moved else ("pullback" if self.pullback is not None else "primal")
        return f"FwdResult({len(self.out)} outputs, {state})"


def _arrived(out: list[Any], res: Any = None) -> FwdResult:
    return FwdResult(out, None, moved=True, res=res)


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


# live pullbacks per (stage, microbatch) tag, and the peak number of microbatches with a
# live pullback per stage: how tests and users check a schedule's memory bound
_LIVE: dict[tuple[Any, Any], int] = {}
_PEAK: dict[Any, int] = {}


def _track(tag: tuple[Any, Any] | None, delta: int) -> None:
    if tag is None or tag[1] is None:
        return
    with _LOCK:
        n = _LIVE.get(tag, 0) + delta
        if n > 0:
            _LIVE[tag] = n
        else:
            _LIVE.pop(tag, None)
        if delta > 0:
            alive = sum(1 for t in _LIVE if t[0] == tag[0])
            _PEAK[tag[0]] = max(_PEAK.get(tag[0], 0), alive)


def peak_live() -> dict[Any, int]:
    """Per stage: the most microbatches whose pullbacks were alive at once in this process."""
    return dict(_PEAK)


def reset_peak_live() -> None:
    """Forget peaks and live tags (a computation abandoned half-way leaves tags behind)."""
    with _LOCK:
        _PEAK.clear()
        _LIVE.clear()


def fwd_task(spec: CallSpec, srcs: tuple[int, ...], dev: int | None, *vals: Any,
             tag: tuple[Any, Any] | None = None, vjp: bool = True, **after: Any) -> FwdResult:
    """Forward of one layer call: outputs plus the pullback (kept in this process).

    `dev`: local JAX device index (single-process stage pinning). `tag`: (stage,
    microbatch) for the live-pullback count. `vjp=False`: no VJP task will ask for a
    pullback (the call does not reach the loss). `after`: ordering-only dependencies.
    """
    try:
        if getattr(spec.layer, "custom", False):
            return _custom_fwd(spec, srcs, vals, _device(dev), tag)
        c = _compiled(spec)
        d, nd = _split(spec, srcs, vals, _device(dev))
        if spec.remat or not d or not vjp:
            return FwdResult(jax.block_until_ready(c.forward(d, nd)), None, tag=tag)
        out, pb = jax.block_until_ready(c.fwd_vjp(d, nd))   # the task ends when its work does
    except Exception as e:
        _note(e, "forward", spec, tag, vals)
        raise
    _track(tag, +1)
    return FwdResult(out, pb, tag=tag)


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
    try:
        error.add_note(note)
    except Exception:                          # Python < 3.11, or a frozen exception
        pass


def vjp_task(spec: CallSpec, srcs: tuple[int, ...], wrt: tuple[int, ...],
             ct_srcs: tuple[int | None, ...], dev: int | None, fwd: FwdResult,
             *vals: Any, release: bool = False, **after: Any) -> tuple[Any, ...]:
    """VJP of one layer call w.r.t. differentiated leaves `wrt` (indices among them).

    `vals` holds the output cotangents (one per non-None entry of `ct_srcs`) followed
    by the primal inputs, which are only read to rebuild a pullback that moved.
    `release`: this is the call's last backward task, so its pullback is dropped after.
    """
    try:
        if getattr(spec.layer, "custom", False):
            return _custom_vjp(spec, srcs, wrt, ct_srcs, dev, fwd, vals)
        out = jax.block_until_ready(_vjp(spec, srcs, wrt, ct_srcs, dev, fwd, vals))
    except Exception as e:
        _note(e, "VJP", spec, getattr(fwd, "tag", None), vals)
        raise
    if release and fwd.pullback is not None:
        fwd.pullback = None
        _track(fwd.tag, -1)
    return out


def _vjp(spec: CallSpec, srcs: tuple[int, ...], wrt: tuple[int, ...],
         ct_srcs: tuple[int | None, ...], dev: int | None, fwd: FwdResult,
         vals: Sequence[Any]) -> tuple[Any, ...]:
    n_ct = sum(s is not None for s in ct_srcs)
    device = _device(dev)
    it = iter(vals[:n_ct])
    cts = [None if s is None else _put(_take(next(it), s), device) for s in ct_srcs]
    c = _compiled(spec)
    pb = fwd.pullback
    if pb is not None:
        return c.bwd(pb, cts, wrt)
    if not spec.remat:
        with _LOCK:
            _COUNTS["remat"] += 1
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
    from .custom import fwd_result

    out, res = fwd_result(_call_rule(spec, spec.layer.fwd_rule,
                                     _dyn_args(spec, srcs, vals, device)), spec.name)
    return FwdResult(jax.tree_util.tree_leaves(out), None, tag=tag, res=res)


def _custom_vjp(spec: CallSpec, srcs: tuple[int, ...], wrt: tuple[int, ...],
                ct_srcs: tuple[int | None, ...], dev: int | None, fwd: FwdResult,
                vals: Sequence[Any]) -> tuple[Any, ...]:
    from .custom import check_cotangents

    n_ct = sum(s is not None for s in ct_srcs)
    it = iter(vals[:n_ct])
    cts = []
    for s, a in zip(ct_srcs, spec.out_avals):
        cts.append(np.zeros(a.shape, a.dtype) if s is None else _take(next(it), s))
    ct = cts[0] if len(cts) == 1 else tuple(cts)
    primals = _dyn_args(spec, srcs, vals[n_ct:], _device(dev))
    got = check_cotangents(spec.layer, spec.layer.bwd_rule(fwd.res, ct), primals, spec.diff)
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
    of its contributions (entries of `vals`) plus its sum from the previous microbatch."""
    device = _device(dev)
    out = []
    for i, (entries, zeros) in enumerate(layout):
        parts = [_put(_take(vals[j], s), device) for j, s in entries]
        if prev is not None:
            parts.append(prev[i])
        if not parts:
            shape, dtype = zeros
            out.append(_put(jnp.zeros(shape, dtype), device))
            continue
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
    from .taskspec import TaskRef

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
