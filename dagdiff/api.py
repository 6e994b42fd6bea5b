"""`dd.value_and_grad` / `dd.grad`: trace a loss function and return Dask collections."""
from __future__ import annotations

import functools
import inspect
from contextvars import ContextVar
import sys
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from dask.delayed import Delayed
from dask.highlevelgraph import HighLevelGraph

from .backward import build_backward
from .errors import ArgumentError, DagdiffError, LayerShapeError, TracerError
from .lower import Lowered, lower, select, trace_token
from .tracer import Trace, Traced, fmt_aval, is_array

__all__ = ["value_and_grad", "grad", "trace_call", "to_delayed"]


def _argnums(argnums: int | Sequence[int], n: int, fname: str,
             option: str = "argnums") -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for a in nums:
        if not isinstance(a, int) or isinstance(a, bool) or not -n <= a < n:
            raise ArgumentError(
                f"{fname}: {option}={argnums!r} but it was called with {n} positional "
                f"arguments; give indices in {-n}..{n - 1}")
    return tuple(a % n for a in nums)


def trace_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               argnums: tuple[int, ...], name: str) -> tuple[Trace, Any, list[Any]]:
    """Run `fn` once under a new trace; array leaves of args become traced inputs.

    Returns the trace, fn's output, and the traced differentiated arguments.
    """
    trace = Trace(name)
    targs = []
    names = _argnames(fn, len(args))
    with trace:
        for i, a in enumerate(args):
            leaves, td = jax.tree_util.tree_flatten_with_path(a)
            new = [trace.add_input(x, _path(names[i], p), i in argnums) if _is_input(x) else x
                   for p, x in leaves]
            targs.append(jax.tree_util.tree_unflatten(td, new))
        if argnums and not any(n.kind == "param" for n in trace.nodes):
            got = []
            for i in argnums:
                leaves = jax.tree_util.tree_leaves(args[i])
                kinds = sorted({fmt_aval(x) if is_array(x) else type(x).__name__
                                for x in leaves})[:4]
                got.append(f"argument {names[i]!r} (position {i}) holds "
                           f"{', '.join(kinds) or 'no leaves'}")
            raise TracerError(
                f"{name}: nothing to differentiate: {'; '.join(got)}, and no floating-point "
                "array. The differentiated argument(s) must be a pytree of float arrays "
                "(e.g. the params); integer leaves get no gradient (as with jax.grad, which "
                "refuses them). Cast the parameters to float (x.astype(jnp.float32)), or pick "
                "argnums=")
        tkw = {k: jax.tree_util.tree_map(
            lambda x: trace.add_input(x, f"kw_{k}", False) if is_array(x) else x, v)
            for k, v in kwargs.items()}
        try:
            out = fn(*targs, **tkw)
        except (TypeError, ValueError) as e:
            text = str(e)
            if isinstance(e, DagdiffError) or not ("__jax_array__" in text or "Traced" in text):
                raise
            raise TracerError(
                f"{name}: a JAX/NumPy function was applied to a traced value outside any "
                f"dd.layer ({type(e).__name__}: {text.splitlines()[0]}). Traced values have "
                "no data while dagdiff traces; move that computation into a function wrapped "
                "in dd.layer."
            ) from e
    return trace, out, [targs[i] for i in argnums]


def _is_input(x: Any) -> bool:
    """Array leaves, and ShapeDtypeStruct placeholders (microbatches built later)."""
    return is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _path(argname: str, path: Any) -> str:
    parts = [argname]
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "_".join(parts)


def _argnames(fn: Callable[..., Any], n: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [names[i] if i < len(names) else f"arg{i}" for i in range(n)]


def _split_aux(out: Any, has_aux: bool, fname: str) -> tuple[Any, Any]:
    """(loss, aux) from what the loss function returned."""
    if not has_aux:
        return out, None
    if not (isinstance(out, tuple) and len(out) == 2):
        what = (f"a {len(out)}-tuple" if isinstance(out, tuple) else
                fmt_aval(out.aval) if isinstance(out, Traced) else type(out).__name__)
        raise TracerError(f"{fname} with has_aux=True must return a 2-tuple (loss, aux), got "
                          f"{what}; return (loss, aux) or drop has_aux=True")
    return out


def _check_loss(loss: Any, trace: Trace, fname: str) -> Traced:
    if isinstance(loss, tuple) and len(loss) == 2 and isinstance(loss[0], Traced):
        raise TracerError(
            f"{fname} returned a 2-tuple, not a scalar loss; if the second item is auxiliary "
            "output, pass has_aux=True (it returns (loss, aux) then)")
    if not isinstance(loss, Traced) or loss.trace is not trace:
        raise TracerError(
            f"{fname} must return a traced scalar (the output of a dd.layer call), got "
            f"{type(loss).__name__}. Compute the loss inside a dd.layer."
        )
    if loss.shape != () or not jax.dtypes.issubdtype(loss.dtype, np.floating):
        raise TypeError(
            f"{fname} must return a real scalar loss, got {fmt_aval(loss.aval)}; reduce it "
            "(e.g. jnp.mean) inside the loss layer."
        )
    return loss


class OutKey(str):
    """A task key that `to_delayed` should turn into a Delayed (other leaves pass through)."""


def to_delayed(graph: Any, token: str, keys: Any) -> Any:
    """Wrap the `OutKey` leaves of a pytree as Delayed objects sharing one graph
    (a task dict, or a ready HighLevelGraph)."""
    if isinstance(graph, HighLevelGraph):
        hlg = graph
    else:
        hlg = HighLevelGraph.from_collections(f"dagdiff-{token}", graph, dependencies=())
    layers = list(hlg.layers)

    def wrap(k: Any) -> Any:
        if not isinstance(k, OutKey):
            return k
        name = next((n for n in layers if k in hlg.layers[n]), layers[0])
        return Delayed(str(k), hlg, layer=name)

    return jax.tree_util.tree_map(wrap, keys, is_leaf=lambda x: x is None)


_CAPTURE: "ContextVar[list[Any] | None]" = ContextVar("dagdiff_capture", default=None)


def _capture(**info: Any) -> None:
    """Hand the pieces of a build to `dd.trace` (when it is listening)."""
    sink = _CAPTURE.get()
    if sink is not None:
        sink.append(info)


def _without_gc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Pause the cyclic garbage collector while building a graph: building allocates many
    small objects, and collections of a large heap (jax, dask, distributed loaded) cost
    more than the building itself."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        import gc

        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return run


def current_client() -> Any:
    """The active distributed client (``Client.as_current()`` or the default), or None."""
    if "distributed" not in sys.modules:
        return None
    from distributed import default_client

    try:
        return default_client()
    except ValueError:
        return None


def value_and_grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0,
                   has_aux: bool = False, *, microbatches: int = 1, schedule: Any = None,
                   batch_argnums: Sequence[int] | None = None, batch_axis: int = 0,
                   stages: int | str | None = None,
                   placement: Mapping[int, Any] | None = None, fuse: bool | None = None,
                   resident: bool = True, dispatch: str | None = None) -> Callable[..., Any]:
    """Like `jax.value_and_grad`, but returns Dask collections and runs nothing.

    ``loss, grads = dd.value_and_grad(loss_fn)(params, x, t)`` traces `loss_fn` once
    (every `dd.layer` call becomes a forward task and a VJP task) and returns `loss`
    as a `dask.delayed.Delayed` and `grads` as a pytree shaped like the differentiated
    argument(s) with Delayed leaves (None for non-array leaves). Compute them with
    `dask.compute`, `Client.compute` or `persist`.

    Placement is decided when tracing. With a distributed client active, stage k runs on
    worker slot ``k mod n`` (`placement={stage: slot}` overrides) and parameters are
    scattered to their stage's worker once and reused while the same arrays are passed
    (`resident=False` ships them with every graph); without one, stage k runs on local
    JAX device ``k mod n``. ``stages="auto"`` (or an int) splits an unstaged model into
    that many stages (auto: one per worker/device) balanced by XLA's cost estimate.
    ``fuse=True`` turns each run of consecutive calls on one stage into a single forward
    and a single VJP task (one jitted function) - faster when layers are small. The
    default (None) fuses pipelines (microbatches > 1 or a schedule) and nothing else.

    ``microbatches=m`` with ``schedule=`` ("gpipe", "1f1b", "interleaved", "zb-h1" or a
    `dd.Schedule`) runs a pipeline: the arguments in `batch_argnums` (default: every
    positional argument not differentiated) are split into m parts along `batch_axis`,
    the model is lowered once per microbatch, and each worker runs its tasks in the
    schedule's order. `loss` is the mean of the microbatch losses and `grads` its
    gradient (equal to the full-batch ones for a mean loss); with `has_aux`, aux is a
    list with one entry per microbatch.

    ``dispatch`` (pipelines on a cluster): "direct" (the default there) runs each worker's
    part of a step as one Dask task (its program), in its schedule order, sending
    activations and cotangents straight to the next worker, with no scheduler round trip
    or Dask task per action (see `dagdiff.direct`). "scheduler" keeps every edge a Dask
    dependency (ordering edges between a worker's actions): slower per action, but Dask
    recomputes lost work.
    """
    fname = getattr(fn, "__name__", "fn")
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    check_dispatch(dispatch)
    if microbatches > 1 or schedule is not None:
        from .pipeline import resolve_schedule

        sched = resolve_schedule(schedule)
        return _pipelined(fn, fname, argnums, has_aux, microbatches, sched, batch_argnums,
                          batch_axis, stages, placement, fuse is not False, resident,
                          dispatch)
    fuse = bool(fuse)

    @functools.wraps(fn)
    @_without_gc
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nums = _argnums(argnums, len(args), fname)
        trace, out, targs = trace_call(fn, args, kwargs, nums, fname)
        loss, aux = _split_aux(out, has_aux, fname)
        loss = _check_loss(loss, trace, fname)
        client = current_client()
        trace, loss, aux = prepare(trace, loss, aux, client, stages, fuse)
        plan = build_backward(trace, loss)
        targets, inputs, home = place(trace, client, placement, resident)
        token = trace_token(trace, (nums, has_aux, fuse, input_keys(inputs)))
        low = lower(trace, plan, token, inputs=inputs,
                    devices=dict(targets.of) if targets.kind == "devices" else None)
        keys = _result_keys(low, trace, loss, aux, targs, token)
        for node, key in low.data_keys.items():
            low.stage_of[key] = home.get(node)
        graph = build_graph(low.dsk, low.stage_of, targets, token)
        lk, ak, gk = to_delayed(graph, token, keys)
        grads = gk[0] if isinstance(argnums, int) else tuple(gk)
        _capture(trace=trace, targets=targets, graph=graph, loss=lk, microbatches=1,
                 schedule=None)
        return ((lk, ak) if has_aux else lk), grads

    return wrapped


def _pipelined(fn: Callable[..., Any], fname: str, argnums: Any, has_aux: bool, m: int,
               sched: Any, batch_argnums: Sequence[int] | None, axis: int, stages: Any,
               placement: Any, fuse: bool, resident: bool,
               dispatch: str | None = None) -> Callable[..., Any]:
    from .pipeline import lower_pipeline, microbatch_avals

    @functools.wraps(fn)
    @_without_gc
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        nums = _argnums(argnums, len(args), fname)
        names = _argnames(fn, len(args))
        batch = ([i for i in range(len(args)) if i not in nums] if batch_argnums is None
                 else list(_argnums(batch_argnums, len(args), fname, "batch_argnums")))
        mb_args = microbatch_avals(args, names, batch, axis, m)
        try:
            trace, out, targs = trace_call(fn, tuple(mb_args), kwargs, nums, fname)
        except LayerShapeError as e:
            unsplit = [f"{k}=" for k, v in kwargs.items()
                       if any(map(is_array, jax.tree_util.tree_leaves(v)))]
            unsplit += [repr(names[i]) for i in range(len(args))
                        if i not in batch and any(map(is_array, jax.tree_util.tree_leaves(
                            args[i]))) and i not in nums]
            if unsplit:
                e.add_note(f"dagdiff: split into {m} microbatches along axis {axis}: "
                           f"{', '.join(repr(names[i]) for i in batch) or 'nothing'}; passed "
                           f"whole to every microbatch: {', '.join(unsplit)} (keyword "
                           "arguments are never split; choose with batch_argnums=)")
            raise
        loss, aux = _split_aux(out, has_aux, fname)
        loss = _check_loss(loss, trace, fname)
        # full-batch values of the placeholder inputs (nodes are created in argument order)
        full: dict[int, Any] = {}
        it = iter(n for n in trace.nodes if n.kind != "call")
        for orig, mb in zip(args, mb_args):
            for o, x in zip(jax.tree_util.tree_leaves(orig), jax.tree_util.tree_leaves(mb)):
                if _is_input(x):
                    node = next(it)
                    if isinstance(x, jax.ShapeDtypeStruct):
                        full[node.index] = o
        client = current_client()
        trace, loss, aux = prepare(trace, loss, aux, client, stages, fuse)
        plan = build_backward(trace, loss)
        token = trace_token(trace, (nums, has_aux, fuse, m, repr(sched), axis,
                                    tuple(sorted(full))))
        from dask.base import tokenize

        targets, inputs, home = place(trace, client, placement, resident)
        mode = resolve_dispatch(dispatch, client, targets)   # part of the keys: the two
        token = token[:8] + tokenize(*full.values(), mode,   # modes' tasks differ
                                     input_keys(inputs), program_homes(mode, targets),
                                     ensure_deterministic=False)[:8]
        pg = lower_pipeline(trace, plan, token, m, sched, full, axis, inputs, home, loss, aux,
                            dict(targets.of) if targets.kind == "devices" else None)
        keys = (OutKey(pg.loss_key),
                jax.tree_util.tree_map(lambda k: OutKey(k) if isinstance(k, str) else k,
                                       pg.aux_keys),
                [jax.tree_util.tree_map(
                    lambda v: OutKey(pg.grad_keys[v.node])
                    if isinstance(v, Traced) and v.node in pg.grad_keys else None,
                    a, is_leaf=lambda x: x is None) for a in targs])
        keep = None
        if mode == "direct":
            keep = {k for k in jax.tree_util.tree_leaves(keys) if isinstance(k, OutKey)}
        graph = build_graph(pg.dsk, pg.stage_of, targets, token, pg.priority, keep)
        lk, ak, gk = to_delayed(graph, token, keys)
        grads = gk[0] if isinstance(argnums, int) else tuple(gk)
        _capture(trace=trace, targets=targets, graph=graph, loss=lk, microbatches=m,
                 schedule=sched)
        return ((lk, ak) if has_aux else lk), grads

    return wrapped


def prepare(trace: Trace, loss: Traced, aux: Any, client: Any, stages: int | str | None,
            fuse: bool) -> tuple[Trace, Traced, Any]:
    """Apply stages="auto"/int and fusion to a fresh trace; remaps loss and aux."""
    from .placement import auto_stages

    if stages is not None:
        if stages == "auto":
            import jax as _jax

            from .cluster import workers_info

            n = (len(workers_info(client)) if client is not None
                 else len(_jax.local_devices()))
        elif isinstance(stages, int) and not isinstance(stages, bool) and stages > 0:
            n = stages
        else:
            raise ValueError(f"stages must be 'auto', a positive int or None, got {stages!r}")
        trace = auto_stages(trace, n)
    if fuse:
        from .fuse import fuse_trace

        keep = {(loss.node, loss.leaf)}
        keep |= {(v.node, v.leaf) for v in jax.tree_util.tree_leaves(aux)
                 if isinstance(v, Traced)}
        trace, remap = fuse_trace(trace, keep)
        loss = remap[(loss.node, loss.leaf)]
        aux = jax.tree_util.tree_map(
            lambda v: remap[(v.node, v.leaf)] if isinstance(v, Traced) else v, aux)
    return trace, loss, aux


def place(trace: Trace, client: Any, placement: Mapping[int, Any] | None, resident: bool
          ) -> tuple[Any, dict[int, tuple[Any, int]], dict[int, int | None]]:
    """Resolve stage targets, and scatter resident parameters when a client is active."""
    from .placement import home_stages, resident_inputs, resolve_targets

    stages = {n.stage for n in trace.nodes if n.kind == "call" and n.stage is not None}
    targets = resolve_targets(stages, client, placement)
    home = home_stages(trace)
    inputs: dict[int, tuple[Any, int]] = {}
    if client is not None:
        from .colocate import ensure_colocation

        ensure_colocation(client)
        if resident:
            inputs = resident_inputs(trace, client, targets, home)
    return targets, inputs, home


def build_graph(dsk: dict[str, Any], stage_of: Mapping[str, int | None], targets: Any,
                token: str, priority: dict[str, int] | None = None,
                keep: set[str] | None = None, client: Any = None,
                outputs: set[str] | None = None) -> HighLevelGraph:
    """One HighLevelGraph layer holding every task, with per-key placement annotations
    (and schedule priorities). `keep`: the step's output keys, given to run it with
    direct dispatch (see `dagdiff.direct`); None keeps every edge a Dask dependency.
    `outputs` (direct dispatch): further outputs read straight from their worker's
    program (see `dagdiff.direct.rewrite`)."""
    from dask.highlevelgraph import MaterializedLayer

    from .placement import annotations_for

    if keep is not None and targets.kind in ("slots", "workers"):
        return _direct_graph(dsk, stage_of, targets, token, priority or {}, keep, client,
                             outputs or set())
    annotations = annotations_for(stage_of, targets)
    if priority:
        annotations["priority"] = priority.get
    name = f"dagdiff-{token}"
    layer = MaterializedLayer(dsk, annotations=annotations or None)
    return HighLevelGraph({name: layer}, {name: set()})


def _direct_graph(dsk: dict[str, Any], stage_of: Mapping[str, int | None], targets: Any,
                  token: str, priority: dict[str, int], keep: set[str],
                  client: Any, outputs: set[str]) -> HighLevelGraph:
    from dask.highlevelgraph import MaterializedLayer

    from .direct import RESOURCE_SHARE, rewrite

    worker_of = {k: targets.target(s) for k, s in stage_of.items()}
    slots = targets.kind == "slots"
    plan = rewrite(dsk, worker_of, priority, keep, targets.addresses, token, slots=slots,
                   outputs=outputs)
    where = {k: w for k, w in worker_of.items() if w is not None}
    where.update(plan.placed)
    prio = {**priority, **plan.priority}
    annotations: dict[str, Any] = {"priority": prio.get}
    if slots:   # shares: a program waiting for its inputs keeps its resources
        annotations["resources"] = {k: {w: RESOURCE_SHARE} for k, w in where.items()}.get
    else:
        annotations["workers"] = {k: [w] for k, w in where.items()}.get
    name = f"dagdiff-{token}"
    layer = MaterializedLayer(plan.dsk, annotations=annotations)
    return HighLevelGraph({name: layer}, {name: set()})


def program_homes(mode: str, targets: Any) -> tuple[Any, ...]:
    """Direct dispatch: the worker addresses a step's programs are built for (part of its
    token: after a worker was replaced, the step built again gets new keys)."""
    if mode != "direct":
        return ()
    return tuple(sorted((str(k), str(v)) for k, v in targets.addresses.items()))


def input_keys(inputs: Mapping[int, Any]) -> tuple[str, ...]:
    """The Dask keys of a step's resident inputs (Futures): part of its token, so a key
    names one computation over those very values (new arrays, new keys)."""
    return tuple(sorted(str(getattr(v[0], "key", v[0])) for v in inputs.values()))


def check_dispatch(dispatch: str | None) -> str | None:
    """Validate a `dispatch=` option."""
    if dispatch not in (None, "direct", "scheduler"):
        raise ValueError(f"dispatch must be 'direct', 'scheduler' or None, got {dispatch!r}")
    return dispatch


def resolve_dispatch(dispatch: str | None, client: Any, targets: Any) -> str:
    """'direct' or 'scheduler' for a pipeline step (None: direct on a cluster, where
    dagdiff's worker plugin gives every worker its direct-dispatch runtime; any comm:
    tcp, tls, inproc, UCX)."""
    check_dispatch(dispatch)
    if client is None or targets.kind not in ("slots", "workers") or dispatch == "scheduler":
        return "scheduler"
    from .colocate import ensure_colocation

    if not ensure_colocation(client):  # dagdiff cannot be loaded on the workers
        if dispatch == "direct":
            import logging

            logging.getLogger(__name__).warning(
                "dagdiff: dispatch='direct' needs dagdiff importable on every worker (its "
                "worker plugin could not be registered); using dispatch='scheduler'.")
        return "scheduler"
    return "direct"


def _result_keys(low: Lowered, trace: Trace, loss: Traced, aux: Any, targs: list[Any],
                 token: str) -> tuple[Any, Any, list[Any]]:
    lk = OutKey(select(low, trace, loss, "loss", token))
    ak = jax.tree_util.tree_map(
        lambda v: OutKey(select(low, trace, v, "aux", token)) if isinstance(v, Traced) else v,
        aux)

    def grad_key(v: Any) -> Any:
        if isinstance(v, Traced) and v.node in low.grad_keys:
            return OutKey(low.grad_keys[v.node])
        return None

    gk = [jax.tree_util.tree_map(grad_key, a, is_leaf=lambda x: x is None) for a in targs]
    return lk, ak, gk


def grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0,
         has_aux: bool = False) -> Callable[..., Any]:
    """Like `jax.grad`: the gradient pytree (Delayed leaves), or (grads, aux)."""
    vg = value_and_grad(fn, argnums=argnums, has_aux=has_aux)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out, grads = vg(*args, **kwargs)
        return (grads, out[1]) if has_aux else grads

    return wrapped
