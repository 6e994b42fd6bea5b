"""Recomputation policies per stage: what a layer call's forward keeps for its backward.

``"none"`` keeps every residual JAX's VJP wants; ``"full"`` keeps only the call's inputs
and runs its forward again in the backward (the call's VJP task recomputes it);
``"selective"`` keeps the matrix products without batch dimensions (a dense layer's
``x @ W``, the expensive part) and recomputes the rest (elementwise work, attention's
batched products): `jax.checkpoint` with ``dots_with_no_batch_dims_saveable``.

A policy applies to every layer call on its stage; in a pipeline those are fused into
one call per stage and microbatch, so ``"full"`` keeps just the stage's input. A layer
made with ``dd.layer(..., remat=True)`` always recomputes, whatever its stage's policy.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..errors import ArgumentError
from .spec import CallSpec


__all__ = ["check_stages", "POLICIES", "RematPolicy", "check_remat", "policy_of", "with_policy",
           "without_policy", "apply_remat"]

#: the policy names `remat=` takes
POLICIES = ("none", "full", "selective")

#: ``remat=`` as `Options` holds it: one policy for every stage, or (stage, policy)
#: pairs (stages left out keep ``"none"``)
RematPolicy = str | tuple[tuple[int, str], ...]


def check_remat(where: str, remat: Any) -> RematPolicy:
    """`remat` validated: a policy name (None: ``"none"``) or ``{stage: policy}``."""
    if remat is None:
        return "none"
    if isinstance(remat, str):
        if remat not in POLICIES:
            raise ArgumentError(f"{where}: remat must be one of {', '.join(map(repr, POLICIES))} "
                                f"or {{stage: policy}}, got {remat!r}")
        return remat
    if isinstance(remat, Mapping):
        out = []
        for stage, policy in remat.items():
            if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
                raise ArgumentError(f"{where}: the keys of remat are stages (ints >= 0), got "
                                    f"{stage!r}; e.g. remat={{0: 'full', 1: 'selective'}}")
            if policy not in POLICIES:
                raise ArgumentError(f"{where}: remat[{stage}] must be one of "
                                    f"{', '.join(map(repr, POLICIES))}, got {policy!r}")
            out.append((stage, policy))
        return tuple(sorted(out))
    raise ArgumentError(f"{where}: remat must be one of {', '.join(map(repr, POLICIES))} or "
                        f"a dict {{stage: policy}}, got {type(remat).__name__} {remat!r}")


def check_stages(where: str, remat: RematPolicy, stages: Any) -> None:
    """Raise if ``{stage: policy}`` names a stage the model does not have (a typo would
    otherwise leave the stage it meant without its policy)."""
    if isinstance(remat, str) or not remat:
        return
    if not stages:
        raise ArgumentError(
            f"{where}: remat={dict(remat)} gives policies per stage, but the model has no "
            "stages (no dd.stage block, no stages=); give one policy for every layer, e.g. "
            "remat='full'")
    unknown = sorted(g for g, _ in remat if g not in stages)
    if unknown:
        raise ArgumentError(
            f"{where}: remat names stage(s) {unknown}, but the model has stages "
            f"{sorted(stages)}; give a policy per existing stage, e.g. "
            f"remat={{{min(stages)}: 'full'}}")


def policy_of(remat: RematPolicy, stage: int | None) -> str:
    """The policy `remat` gives the calls of `stage`."""
    if isinstance(remat, str):
        return remat
    return dict(remat).get(stage, "none") if stage is not None else "none"


def with_policy(spec: CallSpec, policy: str) -> CallSpec:
    """`spec` recomputing as `policy` says (a new fingerprint: another compiled signature)."""
    if policy == "none" or spec.remat or getattr(spec.layer, "custom", False):
        return spec                  # hand-written rules keep their own residuals
    if policy == "full":
        new = dataclasses.replace(spec, remat=True, fingerprint=f"{spec.fingerprint}-rf")
    else:
        new = dataclasses.replace(spec, checkpoint=policy,
                                  fingerprint=f"{spec.fingerprint}-r{policy[0]}")
    object.__setattr__(new, "_treedef", spec.__dict__.get("_treedef"))
    object.__setattr__(new, "_plain", spec)      # this process only (not pickled)
    return new


def without_policy(spec: CallSpec) -> CallSpec:
    """`spec` as it was before `with_policy` gave it a policy (itself if it has none)."""
    return spec.__dict__.get("_plain", spec)


def apply_remat(trace: Any, remat: RematPolicy) -> None:
    """Give each layer call of `trace` its stage's policy (in place; a fresh trace)."""
    if remat == "none" or remat == ():
        return
    check_stages("building the step", remat, {n.stage for n in trace.nodes
                                  if n.kind == "call" and n.stage is not None})
    for i, n in enumerate(trace.nodes):
        if n.kind == "call" and n.spec is not None:
            policy = policy_of(remat, n.stage)
            if policy != "none":
                trace.nodes[i] = dataclasses.replace(n, spec=with_policy(n.spec, policy))
