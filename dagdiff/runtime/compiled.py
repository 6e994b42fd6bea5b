"""Worker-side jit caches of layer signatures, and the counters read by `dd.remat_count` etc."""
from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Sequence

import dask
import jax
import jax.numpy as jnp
import numpy as np

from ..core.spec import CallSpec
from ..core.split import SplitBackward, partition


__all__ = ["compiled", "track_live", "note_remat", "remat_count", "reset_remat_count",
           "compile_count", "cache_info", "peak_live", "reset_peak_live"]

log = logging.getLogger(__name__)


class _Compiled:
    """The jitted functions of one CallSpec (forward, forward+vjp, backward, remat backward,
    and forward+gradients for a call whose output cotangents are known constants)."""

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

        def fwd_res(d: Sequence[Any], nd: Sequence[Any]) -> tuple[list[Any], list[Any]]:
            # the pullback's residuals, less those that are the call's own inputs (a
            # dense layer's weights): a jitted function copies every output, inputs too
            out, pb = fwd_vjp(d, nd)
            leaves, treedef = jax.tree_util.tree_flatten(pb)
            ins = [*jax.tree_util.tree_leaves(d), *jax.tree_util.tree_leaves(nd)]
            where, kept = [], []
            for leaf in leaves:
                i = next((i for i, a in enumerate(ins) if a is leaf), None)
                if i is None:
                    where.append(-1 - len(kept))
                    kept.append(leaf)
                else:
                    where.append(i)
            self._layout[_signature(d, nd)] = (treedef, tuple(where))
            return out, kept

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

        def fwd_grad(d: Sequence[Any], nd: Sequence[Any], cts: Sequence[Any]
                     ) -> tuple[list[Any], tuple[Any, ...]]:
            out, pb = fwd_vjp(d, nd)
            return out, tuple(pb(full_ct(cts)))

        def remat_bwd(d: Sequence[Any], nd: Sequence[Any], cts: Sequence[Any],
                      wrt: tuple[int, ...]) -> tuple[Any, ...]:
            _, pb = fwd_vjp(d, nd)
            return bwd(pb, cts, wrt)

        self._full_ct = full_ct
        self._fwd_vjp_fn = fwd_vjp
        self._out_avals = out_avals
        self._layout: dict[Any, tuple[Any, tuple[int, ...]]] = {}
        self._unmatched: set[Any] = set()
        self._splits: dict[Any, SplitBackward | None] = {}
        self._verified: set[Any] = set()
        self._name = spec.name
        self._fwd_res = jax.jit(fwd_res)
        self._fwd_vjp = jax.jit(fwd_vjp)
        self.forward = jax.jit(primal)
        self.fwd_grad = jax.jit(fwd_grad)
        self.bwd = jax.jit(bwd, static_argnums=2)
        self.remat_bwd = jax.jit(remat_bwd, static_argnums=3)

    def fwd_vjp(self, d: Sequence[Any], nd: Sequence[Any]) -> tuple[list[Any], Any]:
        """Outputs and pullback of the call (`jax.vjp` under jit), the pullback rebuilt
        around the residuals that are the call's inputs, which are not copied."""
        key = _signature(d, nd)
        if key in self._unmatched:
            return self._fwd_vjp(d, nd)
        out, kept = self._fwd_res(d, nd)
        layout = self._layout.get(key)
        if layout is None:       # inputs whose abstract values differ inside the trace
            self._unmatched.add(key)
            return self._fwd_vjp(d, nd)
        treedef, where = layout
        ins = [*jax.tree_util.tree_leaves(d), *jax.tree_util.tree_leaves(nd)]
        leaves = [ins[i] if i >= 0 else kept[-1 - i] for i in where]
        return out, jax.tree_util.tree_unflatten(treedef, leaves)

    def split_bwd(self, pb: Any, cts: Sequence[Any], first: tuple[int, ...],
                  second: tuple[int, ...]
                  ) -> tuple[tuple[Any, ...], SplitBackward, tuple[Any, ...]] | None:
        """The gradients of the differentiated inputs `first`, plus what gives those of
        `second` later without walking the backward again: ``(grads, parts, stash)``,
        then ``parts.run_second(stash)`` (`dagdiff.core.split`). None when the
        backward cannot be split that way."""
        p_leaves, p_tree = jax.tree_util.tree_flatten(pb)
        c_leaves, c_tree = jax.tree_util.tree_flatten(list(cts))
        flat = [*p_leaves, *c_leaves]
        full_ct = self._full_ct

        def whole(pl: list[Any], cl: list[Any]) -> list[Any]:
            g = jax.tree_util.tree_unflatten(p_tree, pl)(
                full_ct(jax.tree_util.tree_unflatten(c_tree, cl)))
            return [g[i] for i in first] + [g[i] for i in second]

        got = self._run_first(("bwd", p_tree, c_tree, _avals(flat), first, second), flat,
                              lambda: jax.make_jaxpr(whole)(p_leaves, c_leaves), len(first),
                              len(first) + len(second))
        if got is None:
            return None
        parts, (grads, stash) = got
        return grads, parts, stash

    def fwd_grad_split(self, d: Sequence[Any], nd: Sequence[Any], cts: Sequence[Any],
                       first: tuple[int, ...], second: tuple[int, ...]
                       ) -> tuple[list[Any], tuple[Any, ...], SplitBackward, tuple[Any, ...]] \
            | None:
        """`fwd_grad` that stops after the gradients of `first`: ``(outputs, grads of
        first, parts, stash)``, and ``parts.run_second(stash)`` gives those of `second`
        (a zero-bubble schedule's loss call: its F and I run together, its W later).
        None when the work cannot be split that way."""
        d_leaves, d_tree = jax.tree_util.tree_flatten(list(d))
        n_leaves, n_tree = jax.tree_util.tree_flatten(list(nd))
        c_leaves, c_tree = jax.tree_util.tree_flatten(list(cts))
        flat = [*d_leaves, *n_leaves, *c_leaves]
        n_out = len(self._out_avals)
        fwd_vjp, full_ct = self._fwd_vjp_fn, self._full_ct

        def whole(dl: list[Any], nl: list[Any], cl: list[Any]) -> list[Any]:
            out, pb = fwd_vjp(jax.tree_util.tree_unflatten(d_tree, dl),
                              jax.tree_util.tree_unflatten(n_tree, nl))
            g = pb(full_ct(jax.tree_util.tree_unflatten(c_tree, cl)))
            return [*out, *(g[i] for i in first), *(g[i] for i in second)]

        got = self._run_first(("fwd", d_tree, n_tree, c_tree, _avals(flat), first, second),
                              flat, lambda: jax.make_jaxpr(whole)(d_leaves, n_leaves, c_leaves),
                              n_out + len(first), n_out + len(first) + len(second))
        if got is None:
            return None
        parts, (head, stash) = got
        return list(head[:n_out]), tuple(head[n_out:]), parts, stash

    def _run_first(self, key: Any, flat: list[Any], trace: Any, n_first: int, n_out: int
                   ) -> tuple[SplitBackward, tuple[tuple[Any, ...], tuple[Any, ...]]] | None:
        """Run the first part of split `key` on `flat` (None: no split). The split is
        made once per key from the jaxpr `trace()` gives (`n_out` outputs, cut after
        `n_first`). Its first run compiles it; if tracing, cutting or that run fails, the
        split is dropped and the caller falls back to the unsplit functions (the first
        part's own errors then recur there)."""
        if key not in self._splits:
            self._splits[key] = _try_partition(trace, n_first, n_out)
        parts = self._splits[key]
        if parts is None:
            return None
        if key in self._verified:
            return parts, parts.run_first(flat)
        try:
            out = parts.run_first(flat)
        except Exception as e:                  # noqa: BLE001 - fall back, said once
            log.warning("dagdiff: could not split %s's backward (%s: %s); its I and W run "
                        "apart", self._name, type(e).__name__, e)
            self._splits[key] = None
            return None
        self._verified.add(key)
        return parts, out


def _try_partition(trace: Any, n_first: int, n_out: int) -> SplitBackward | None:
    """`partition` of the jaxpr `trace()` gives (None when it has not `n_out` outputs, or
    when tracing or cutting it fails: the unsplit functions then serve)."""
    try:
        closed = trace()
        if len(closed.jaxpr.outvars) != n_out:
            return None
        return partition(closed, n_first)
    except Exception as e:                      # noqa: BLE001 - jax internals differ
        log.debug("dagdiff: no split backward (%s: %s)", type(e).__name__, e)
        return None


def _avals(xs: Sequence[Any]) -> tuple[Any, ...]:
    return tuple((getattr(x, "shape", None), getattr(x, "dtype", None)) for x in xs)


def _signature(d: Sequence[Any], nd: Sequence[Any]) -> tuple[Any, ...]:
    """The arguments' structure, shapes and dtypes, the same outside a trace and in it."""
    leaves, treedef = jax.tree_util.tree_flatten((d, nd))
    return (treedef, *((getattr(x, "shape", None), getattr(x, "dtype", None)) for x in leaves))


#: one entry per layer signature (function, argument layout, shapes): a batch whose
#: shapes change makes new signatures, so the cache is bounded (least recently used
#: first out; config ``dagdiff.compiled-signatures``, default 1024 per process)
_CACHE: "collections.OrderedDict[str, _Compiled]" = collections.OrderedDict()


_LOCK = threading.Lock()


_COUNTS = {"remat": 0, "compile": 0, "evicted": 0}


def _limit() -> int:
    return max(1, int(dask.config.get("dagdiff.compiled-signatures", 1024)))


def compiled(spec: CallSpec) -> _Compiled:
    """The jitted functions of `spec`'s signature in this process (made on first use)."""
    c = _CACHE.get(spec.fingerprint)
    if c is None:
        with _LOCK:
            c = _CACHE.get(spec.fingerprint)
            if c is None:
                c = _CACHE[spec.fingerprint] = _Compiled(spec)
                _COUNTS["compile"] += 1
                limit = _limit()
                while len(_CACHE) > limit:
                    _CACHE.popitem(last=False)
                    _COUNTS["evicted"] += 1
    else:
        try:
            _CACHE.move_to_end(spec.fingerprint)
        except KeyError:                   # evicted by another thread meanwhile
            pass
    return c


def note_remat() -> None:
    """Count one pullback rebuilt because it had left its forward's process."""
    with _LOCK:
        _COUNTS["remat"] += 1


def remat_count() -> int:
    """Pullbacks rebuilt in this process because they had left the process of their forward."""
    return _COUNTS["remat"]


def reset_remat_count() -> None:
    _COUNTS["remat"] = 0


def compile_count() -> int:
    """Layer signatures compiled in this process (one per worker and signature, not per
    task; a batch of a new shape is a new signature)."""
    return _COUNTS["compile"]


def cache_info() -> dict[str, int]:
    """This process's signature cache: ``compiled`` (signatures made so far), ``cached``
    (held now), ``evicted`` (dropped as least recently used) and ``limit``."""
    return {"compiled": _COUNTS["compile"], "cached": len(_CACHE),
            "evicted": _COUNTS["evicted"], "limit": _limit()}


# live pullbacks per (stage, microbatch) tag, and the peak number of microbatches with a
# live pullback per stage: how tests and users check a schedule's memory bound
_LIVE: dict[tuple[Any, Any], int] = {}


_PEAK: dict[Any, int] = {}


def track_live(tag: tuple[Any, Any] | None, delta: int) -> None:
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
