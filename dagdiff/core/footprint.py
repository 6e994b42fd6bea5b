"""What a stage holds: its parameters, and what one live microbatch keeps from its
forward to its backward under each recomputation policy (from the traced avals).

A live microbatch of a stage keeps, until its backward has run: the values it received
(its inputs that are not parameters), the outputs of its layer calls (a forward task's
value is held until its VJP task has read it), and the residuals of each call's
pullback that are not its own inputs, which is what a recomputation policy changes
(`dagdiff.core.remat`): none are kept under ``"full"``, the products without batch
dimensions under ``"selective"``. The residuals are read off `jax.vjp` under
`jax.eval_shape`, the same function the forward task runs, so nothing is computed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .remat import POLICIES, with_policy, without_policy
from .spec import CallSpec
from .tracer import Trace, Traced, aval_of, home_stages


__all__ = ["StageFootprint", "nbytes", "residual_bytes", "stage_footprints",
           "recompute_shares"]


def nbytes(aval: Any) -> int:
    """Bytes of one array of `aval`'s shape and dtype."""
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


@dataclass(frozen=True)
class StageFootprint:
    """One stage's bytes: ``params`` (its differentiated parameters; the gradient
    accumulator is as large), ``kept`` (per policy name: what one live microbatch keeps
    from its forward to its backward), ``output`` (the activations it sends on, per
    microbatch: the cotangent that comes back is as large), ``stash`` (what a split
    backward's I leaves for its W: the cotangents of the stage's layer outputs),
    ``inputs`` (one microbatch of the batch inputs it reads: a step holds the whole batch
    on the stage's worker, each microbatch a view of it), ``received`` (the activations a
    microbatch brings from earlier stages: part of ``kept``, and all a forward fused
    with its backward keeps of them until its VJP task has run)."""

    stage: int
    params: int
    kept: tuple[tuple[str, int], ...]
    output: int
    stash: int = 0
    inputs: int = 0
    received: int = 0

    def kept_by(self, policy: str) -> int:
        return dict(self.kept)[policy]


def residual_bytes(spec: CallSpec, avals: list[Any]) -> int:
    """Bytes of the residuals `spec`'s pullback keeps beyond the call's own inputs (the
    forward task's ``fwd_res``), for dynamic inputs of `avals`; 0 when the call
    recomputes (``remat``) or has hand-written rules."""
    if spec.remat or getattr(spec.layer, "custom", False) or not any(spec.diff):
        return 0
    hit = _RESIDUALS.get(spec.fingerprint)   # the fingerprint names the input avals too
    if hit is None:
        hit = _RESIDUALS[spec.fingerprint] = _residual_bytes(spec, avals)
        while len(_RESIDUALS) > 4096:
            _RESIDUALS.pop(next(iter(_RESIDUALS)))
    return hit


#: residual bytes per spec fingerprint (a build checks them every template miss)
_RESIDUALS: dict[str, int] = {}


def _residual_bytes(spec: CallSpec, avals: list[Any]) -> int:
    d = [a for a, f in zip(avals, spec.diff) if f]
    nd = [a for a, f in zip(avals, spec.diff) if not f]

    def kept(d: list[Any], nd: list[Any]) -> list[Any]:
        def primal(*dd: Any) -> list[Any]:
            di, ni = iter(dd), iter(nd)
            return jax.tree_util.tree_leaves(
                spec.call([next(di) if f else next(ni) for f in spec.diff]))

        _, pb = jax.vjp(primal, *d)
        ins = [*d, *nd]
        out, seen = [], set()
        for leaf in jax.tree_util.tree_leaves(pb):
            if any(leaf is a for a in ins) or id(leaf) in seen:
                continue
            seen.add(id(leaf))
            out.append(leaf)
        return out

    try:
        shapes = jax.eval_shape(kept, d, nd)
    except Exception:                       # noqa: BLE001 - a layer eval_shape cannot trace
        return 0
    return sum(nbytes(s) for s in shapes if hasattr(s, "shape"))


def stage_footprints(trace: Trace, policies: tuple[str, ...] = POLICIES
                     ) -> dict[int, StageFootprint]:
    """Per stage of `trace` (stages, runs fused or not): its `StageFootprint`, the
    residuals worked out for each of `policies` (applied on top of the layers' own
    ``remat``, to each call as it was before a build gave it its stage's policy)."""
    params: dict[int, int] = {}
    for node, stage in home_stages(trace).items():
        if stage is not None and trace.nodes[node].kind == "param":
            params[stage] = params.get(stage, 0) + nbytes(trace.nodes[node].out_avals[0])
    base: dict[int, int] = {}           # inputs received + outputs of its calls
    outs: dict[int, int] = {}
    res: dict[int, dict[str, int]] = {}
    stash: dict[int, int] = {}
    batch: dict[int, int] = {}
    recv: dict[int, int] = {}
    seen: set[tuple[int, int, int]] = set()
    read_by: dict[tuple[int, int], set[int | None]] = {}     # value -> stages reading it
    for n in trace.nodes:
        if n.kind == "call":
            for _, x in n.traced_inputs:
                read_by.setdefault((x.node, x.leaf), set()).add(n.stage)
    for n in trace.nodes:
        if n.kind != "call" or n.stage is None:
            continue
        g = n.stage
        for _, x in n.traced_inputs:
            src = trace.nodes[x.node]
            if src.kind == "param" or (src.kind == "call" and src.stage == g):
                continue
            if (x.node, x.leaf, g) not in seen:
                seen.add((x.node, x.leaf, g))
                if src.kind == "input":           # a view of the batch the step holds
                    batch[g] = batch.get(g, 0) + nbytes(x.aval)
                else:
                    base[g] = base.get(g, 0) + nbytes(x.aval)
                    recv[g] = recv.get(g, 0) + nbytes(x.aval)
        inner = getattr(n.spec.layer.fn, "steps", None)     # a fused run's layer calls
        stash[g] = stash.get(g, 0) + (
            sum(nbytes(a) for sub, _ in inner for a in sub.out_avals if a.shape)
            if inner else sum(nbytes(a) for a in n.out_avals if a.shape))
        for leaf, aval in enumerate(n.out_avals):
            base[g] = base.get(g, 0) + nbytes(aval)
            if read_by.get((n.index, leaf), set()) - {None, g}:
                outs[g] = outs.get(g, 0) + nbytes(aval)
        avals = [x.aval if isinstance(x, Traced) else aval_of(x)
                 for x, k in zip(n.in_leaves, n.spec.kinds) if k == "d"]
        spec = without_policy(n.spec)        # the residuals of each policy, from scratch
        per = res.setdefault(g, {})
        for policy in policies:
            per[policy] = per.get(policy, 0) + residual_bytes(with_policy(spec, policy), avals)
    stages = sorted(set(base) | set(params))
    return {g: StageFootprint(g, params.get(g, 0),
                              tuple((p, base.get(g, 0) + res.get(g, {}).get(p, 0))
                                    for p in policies), outs.get(g, 0), stash.get(g, 0),
                              batch.get(g, 0), recv.get(g, 0))
            for g in stages}


def _work(fn: Any, *avals: Any) -> float:
    """XLA's estimate of `fn`'s work on `avals`: flops plus transcendentals (tanh, exp
    cost as much as a multiply-add here, roughly what a CPU or GPU pays)."""
    ca = jax.jit(fn).lower(*avals).cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    return float((ca or {}).get("flops", 0.0)) + float((ca or {}).get("transcendentals", 0.0))


def _backward_work(spec: CallSpec, avals: list[Any]) -> tuple[float, float]:
    """(forward work, forward+backward work) of `spec` as `jax.vjp` runs it."""
    d = [a for a, f in zip(avals, spec.diff) if f]
    nd = [a for a, f in zip(avals, spec.diff) if not f]

    def primal(d: list[Any], nd: list[Any]) -> list[Any]:
        di, ni = iter(d), iter(nd)
        return jax.tree_util.tree_leaves(spec.call([next(di) if f else next(ni)
                                                    for f in spec.diff]))

    outs = jax.eval_shape(primal, d, nd)

    def both(d: list[Any], nd: list[Any], cts: list[Any]) -> Any:
        _, pb = jax.vjp(lambda *dd: primal(list(dd), nd), *d)
        return pb(cts)

    cts = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs]
    return _work(primal, d, nd), _work(both, d, nd, cts)


def recompute_shares(trace: Trace, policies: tuple[str, ...] = ("selective",)
                     ) -> dict[int, dict[str, float]]:
    """Per stage and policy: the share of the stage's forward work its backward runs
    again (XLA's cost estimate of the backward under the policy less that without it,
    over the forward's). ``"full"`` is 1 by construction (the forward runs again)."""
    fwd: dict[int, float] = {}
    extra: dict[int, dict[str, float]] = {}
    for n in trace.nodes:
        if n.kind != "call" or n.stage is None or not any(n.spec.diff) \
                or getattr(n.spec.layer, "custom", False):
            continue
        avals = [x.aval if isinstance(x, Traced) else aval_of(x)
                 for x, k in zip(n.in_leaves, n.spec.kinds) if k == "d"]
        try:
            f0, b0 = _backward_work(n.spec, avals)
            per = extra.setdefault(n.stage, {})
            for policy in policies:
                _, b1 = _backward_work(with_policy(n.spec, policy), avals) \
                    if policy != "full" else (0.0, b0 + f0)
                per[policy] = per.get(policy, 0.0) + max(b1 - b0, 0.0)
        except Exception:                  # noqa: BLE001 - no estimate for this call
            continue
        fwd[n.stage] = fwd.get(n.stage, 0.0) + f0
    return {g: {p: min(1.0, v / fwd[g]) if fwd.get(g) else 0.0 for p, v in per.items()}
            for g, per in extra.items()}
