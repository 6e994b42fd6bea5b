"""The one build path: trace a loss function, prepare the trace (stages, fusion), derive
the backward, place the stages, lower to tasks and assemble the Dask graph.

`dd.value_and_grad`, `dd.grad` and `dd.trace` call `build`. `dd.Trainer` extends it: it
shares the first half (`trace_model`: tracing, module arguments, stages and fusion), the
keys (`step_token`, `program_homes`, `resolve_dispatch`) and the pipelined lowering
(`step`: `lower_replicas`, `compile_step` and its templates), and adds its replica
groups, all-reduce, updates and mean loss (`dagdiff.train.step_graph`). What the
Trainer needs from the layers below comes through this package.
`options`: the options a build takes (`Options`); `step`: the shared pipelined core;
`heap`: the client's garbage collector around builds (paused while building; the
long-lived heap frozen after the first steps).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import dask
import jax
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from ..cluster.info import workers_info
from ..cluster.residency import resident_inputs
from ..cluster.targets import Targets, resolve_targets
from ..core.auto import auto_stages, is_cost_source
from ..core.backward import BackwardPlan, build_backward
from ..core.forms import ModelForm, lower_args
from ..core.fuse import fuse_trace
from ..core.remat import apply_remat
from ..core.keys import make_key
from ..core.microbatch import microbatch_avals
from ..core.trace_fn import argnames, argnums_of, check_loss, is_input, split_aux, trace_call
from ..core.tracer import Trace, Traced, home_stages, is_array
from ..errors import ArgumentError, LayerShapeError
from ..lowering import template as templates
from ..lowering.collection import DelayedTree, needs_collection
from ..lowering.graph import OutKey, assemble, pinned, submit, to_delayed
from ..lowering.lower import lower, select, trace_token
from ..lowering.pipeline import stage_workers
from ..runtime.direct.inbox import inbox_for, pushes_enabled
from ..runtime.plugins import ensure_colocation
from ..runtime.shippable import check_shippable
from .heap import freeze_heap, without_gc
from .options import DISPATCH_MODES, LOWERING_SETTINGS, Options
from .step import (Binding, Source, StepTasks, WindowError, chain_steps, compile_step,
                   gather_graph, lower_replicas, push_loss, replace_stages, window_graph)


__all__ = [
    # the build path and its records
    "Options", "Model", "Build", "build", "trace_model", "targets_and_inputs",
    "resolve_dispatch", "step_token", "program_homes", "DISPATCH_MODES", "LOWERING_SETTINGS",
    # the pipelined core the Trainer extends (`step`), and the collector policy (`heap`)
    "Binding", "StepTasks", "compile_step", "lower_replicas", "replace_stages",
    "chain_steps", "Source", "window_graph", "WindowError", "gather_graph", "push_loss",
    "without_gc", "freeze_heap",
    # what the Trainer needs from the layers below, through this package
    "OutKey", "to_delayed", "submit", "stage_workers", "pinned", "templates", "inbox_for",
    "pushes_enabled",
]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Model:
    """A traced and prepared loss function, before placement: the trace (stages assigned,
    runs fused), its backward plan, the loss/aux values, the traced differentiated
    arguments, and, for a pipeline, the full-batch value of each microbatched input
    node (`batch`)."""

    name: str
    trace: Trace
    plan: BackwardPlan
    loss: Traced
    aux: Any
    diff_args: tuple[Any, ...]
    argnums: tuple[int, ...]
    batch_argnums: tuple[int, ...]
    batch: Mapping[int, Any]
    #: differentiated arguments given as modules (position -> `ModelForm`): traced as
    #: their `params()` dicts, their gradients given back in the library's form
    forms: Mapping[int, ModelForm] = dataclasses.field(default_factory=dict)

    @property
    def stages(self) -> set[int]:
        return self.trace.stages


@dataclass(frozen=True)
class Build:
    """One built step: the model, where its stages run, the Dask graph and the keys of its
    outputs (`keys`: (loss, aux, grads) with `OutKey` leaves)."""

    model: Model
    options: Options
    targets: Targets
    graph: HighLevelGraph
    keys: tuple[Any, Any, Any]
    token: str
    dispatch: str

    def outputs(self) -> tuple[Any, Any]:
        """What `value_and_grad` returns: ``(loss, grads)`` (``((loss, aux), grads)`` with
        has_aux), Delayed objects over the one graph."""
        return self._shaped(to_delayed(self.graph, self.keys), delayed=True)

    def values(self, client: Any) -> tuple[Any, Any]:
        """`outputs` computed now on `client`, as values. With direct dispatch each
        worker's outputs come back in one task (`gather_graph`), not one task each, and
        its program pushes them to the client's inbox as it ends (`runtime.direct.inbox`:
        the client takes them as they arrive, or gathers them from Dask when a push does
        not come)."""
        keys = [str(k) for k in jax.tree_util.tree_leaves(self.keys) if isinstance(k, OutKey)]
        box = inbox_for(client) if self.dispatch == "direct" else None
        if box is not None and not box.ready(self.targets.worker_addresses()):
            box = None                          # this step gathers; later ones may push
        graph, where = (gather_graph(self.graph, keys, inbox=box.id if box else "")
                        if self.dispatch == "direct"
                        else (self.graph, {k: (k, None) for k in keys}))
        wanted = list(dict.fromkeys(src for src, _ in where.values()))
        if box is not None and not all(
                getattr(graph[k], "kwargs", {}).get("inbox") == box.id for k in wanted):
            box = None                          # not every output is a pushing program
        got = None
        if box is not None:
            box.expect(wanted)
        try:
            futures = submit(client, graph, wanted)
        except BaseException:
            if box is not None:
                box.forget(wanted)
            raise
        if box is not None:
            got = box.take(wanted, futures)    # the programs' pushes, or None: gather
            if got is not None:
                box.trail(futures)             # their tasks end a moment later
        if got is None:
            got = dict(zip(wanted, client.gather(futures)))
        values = {k: got[src] if i is None else got[src][i] for k, (src, i) in where.items()}
        return self._shaped(jax.tree_util.tree_map(
            lambda k: values[str(k)] if isinstance(k, OutKey) else k, self.keys,
            is_leaf=lambda x: x is None), delayed=False)

    def _shaped(self, outs: tuple[Any, Any, Any], delayed: bool) -> tuple[Any, Any]:
        """(loss, aux, grads) as `value_and_grad` gives them: grads in the form of each
        differentiated argument (`delayed`: Delayed leaves, `_user_form`)."""
        lk, ak, gk = outs
        forms = self.model.forms
        gk = [_user_form(g, forms.get(i), delayed) for i, g in zip(self.model.argnums, gk)]
        grads = gk[0] if isinstance(self.options.argnums, int) else tuple(gk)
        return ((lk, ak) if self.options.has_aux else lk), grads


def _returned(model: Model) -> tuple[Any, ...]:
    """Which traced values a step returns: its loss, and per aux leaf its value or the
    place of a literal (part of a template key: a template keeps the keys of the values
    it returned)."""
    leaves, treedef = jax.tree_util.tree_flatten(model.aux)
    return ((model.loss.node, model.loss.leaf), str(treedef),
            tuple((v.node, v.leaf) if isinstance(v, Traced) else None for v in leaves))


def _aux_outputs(aux_keys: Sequence[Any], aux: Any) -> list[Any]:
    """A pipelined step's aux (one tree per microbatch, shaped as the traced `aux`): the
    key of each traced value as an `OutKey`, and every other leaf (a string, a number
    the loss function returned) this trace's own, not one a reused template kept from
    the step it was lowered for, nor a string taken for a key."""
    leaves, treedef = jax.tree_util.tree_flatten(aux)
    out = []
    for tree in aux_keys:
        keys = treedef.flatten_up_to(tree)
        out.append(treedef.unflatten([OutKey(k) if isinstance(v, Traced) else v
                                      for k, v in zip(keys, leaves)]))
    return out


def _user_form(grads: Any, form: ModelForm | None, delayed: bool = True) -> Any:
    """One argument's gradients as the user gave the argument: a module's in its library's
    form; with Delayed leaves, pytrees Dask cannot walk into (modules, registered
    classes) as a `DelayedTree`."""
    if form is not None:
        grads = form.grads(grads)
    return DelayedTree(grads) if delayed and needs_collection(grads) else grads


def trace_model(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                options: Options, client: Any, *, splits: int | None = None) -> Model:
    """Trace `fn(*args, **kwargs)` and prepare it: the first half of every build.

    With a pipeline (or `splits`, the Trainer's replicas x microbatches), the batch
    arguments are traced as one microbatch's shapes; the full values are kept in
    `Model.batch`."""
    fname = getattr(fn, "__name__", "fn")
    nums = argnums_of(options.argnums, len(args), fname)
    fn, args, forms = lower_args(fn, args, nums)       # modules -> their params dicts
    names = argnames(fn, len(args))
    m = splits if splits is not None else options.microbatches
    if options.pipelined or splits is not None:
        batch_nums = (tuple(i for i in range(len(args)) if i not in nums)
                      if options.batch_argnums is None
                      else argnums_of(options.batch_argnums, len(args), fname, "batch_argnums"))
        both = [i for i in batch_nums if i in nums]
        if both and m > 1 and splits is None:
            i = both[0]
            raise ArgumentError(
                f"{fname}: argument {names[i]!r} (position {i}) is both differentiated "
                f"(argnums={options.argnums!r}) and split into {m} microbatches "
                f"(batch_argnums={options.batch_argnums!r}); dagdiff sums a differentiated "
                "argument's gradient over the microbatches (as for parameters), which for a "
                "split argument would be one microbatch's shape, not the batch's. Take its "
                "gradient without microbatches (microbatches=1), or leave it out of "
                "batch_argnums")
        traced_args = microbatch_avals(args, names, batch_nums, options.batch_axis, m)
    else:
        batch_nums, traced_args = (), list(args)
    try:
        trace, out, targs = trace_call(fn, tuple(traced_args), dict(kwargs), nums, fname)
    except LayerShapeError as e:
        if batch_nums:
            _note_split(e, args, kwargs, names, batch_nums, nums, options.batch_axis, m)
        raise
    loss, aux = split_aux(out, options.has_aux, fname)
    loss = check_loss(loss, trace, fname, aux=options.where != "dd.Trainer")
    if client is not None:                     # the step's tasks will be pickled
        check_shippable(trace)
    # full-batch values of the placeholder inputs (input nodes are made in argument order)
    batch: dict[int, Any] = {}
    it = iter(n for n in trace.nodes if n.kind != "call")
    for orig, traced in zip(args, traced_args):
        for o, x in zip(jax.tree_util.tree_leaves(orig), jax.tree_util.tree_leaves(traced)):
            if is_input(x):
                node = next(it)
                if isinstance(x, jax.ShapeDtypeStruct) and not isinstance(
                        o, jax.ShapeDtypeStruct):
                    batch[node.index] = o
    trace, loss, aux = _prepare(trace, loss, aux, client, options)
    plan = build_backward(trace, loss)
    return Model(fname, trace, plan, loss, aux, tuple(targs), nums, tuple(batch_nums), batch,
                 forms)


def _note_split(e: BaseException, args: Sequence[Any], kwargs: Mapping[str, Any],
                names: Sequence[str], batch: Sequence[int], nums: Sequence[int], axis: int,
                m: int) -> None:
    """Say, on a shape error of a microbatched trace, what was split and what was not."""
    unsplit = [f"{k}=" for k, v in kwargs.items()
               if any(map(is_array, jax.tree_util.tree_leaves(v)))]
    unsplit += [repr(names[i]) for i in range(len(args))
                if i not in batch and i not in nums
                and any(map(is_array, jax.tree_util.tree_leaves(args[i])))]
    # differentiated arguments are never split (their gradient is summed over the
    # microbatches): named when there is one beside the first (the parameters)
    whole = [repr(names[i]) for i in nums if i < len(args)
             and any(map(is_array, jax.tree_util.tree_leaves(args[i])))]
    if unsplit or len(whole) > 1:
        e.add_note(f"dagdiff: split into {m} microbatches along axis {axis}: "
                   f"{', '.join(repr(names[i]) for i in batch) or 'nothing'}; passed whole "
                   f"to every microbatch: {', '.join([*whole, *unsplit])} (differentiated "
                   "arguments and keyword arguments are never split; choose with "
                   "batch_argnums=, and take a batch argument's gradient without "
                   "microbatches)")


def _prepare(trace: Trace, loss: Traced, aux: Any, client: Any,
             options: Options) -> tuple[Trace, Traced, Any]:
    """Apply stages="auto"/int/profile and fusion to a fresh trace; remaps loss and aux."""
    if is_cost_source(options.stages):         # a dd.Profile: its measured times
        source: Any = options.stages
        trace = auto_stages(trace, source.num_stages, source.layer_costs_for(trace))
    elif options.stages is not None:
        n = options.stages if options.stages != "auto" else (
            len(workers_info(client)) if client is not None else len(jax.local_devices()))
        trace = auto_stages(trace, n)
    if options.fuse:
        keep = {(loss.node, loss.leaf)}
        keep |= {(v.node, v.leaf) for v in jax.tree_util.tree_leaves(aux)
                 if isinstance(v, Traced)}
        trace, remap = fuse_trace(trace, keep)
        loss = remap[(loss.node, loss.leaf)]
        aux = jax.tree_util.tree_map(
            lambda v: remap[(v.node, v.leaf)] if isinstance(v, Traced) else v, aux)
    apply_remat(trace, options.remat)
    return trace, loss, aux


def targets_and_inputs(trace: Trace, stages: set[int], client: Any, options: Options
                       ) -> tuple[Targets, dict[int, tuple[Any, int]]]:
    """Resolve stage targets (a pipeline's stages where its schedule's layout puts them)
    and, with a client, scatter resident parameters (once)."""
    default = (stage_workers(options.schedule, trace.num_stages)
               if options.pipelined and stages else None)
    targets = resolve_targets(stages, client, dict(options.placement), default)
    inputs: dict[int, tuple[Any, int]] = {}
    if client is not None:
        ensure_colocation(client)
        if options.resident:
            inputs = resident_inputs(trace, client, targets, home_stages(trace))
    return targets, inputs


def resolve_dispatch(dispatch: str | None, client: Any, targets: Targets) -> str:
    """'direct' or 'scheduler' for a pipeline step (None: direct on a cluster, where
    dagdiff's worker plugin gives every worker its direct-dispatch runtime; any comm:
    tcp, tls, inproc, UCX)."""
    if client is None or not targets.on_workers or dispatch == "scheduler":
        return "scheduler"
    if not ensure_colocation(client):  # dagdiff cannot be loaded on the workers
        if dispatch == "direct":
            log.warning("dagdiff: dispatch='direct' needs dagdiff importable on every worker "
                        "(its worker plugin could not be registered); using "
                        "dispatch='scheduler'.")
        return "scheduler"
    return "direct"


def step_token(trace: Trace, *parts: Any) -> str:
    """A step's token: the trace's structure and input values, plus `parts` (options,
    the keys of resident Futures, full batch values, worker addresses...). A key names
    one computation: new arrays, new keys; the same step again, the same keys."""
    return tokenize(trace_token(trace, parts[:1]), *parts[1:],
                    ensure_deterministic=False)[:16]


def input_keys(inputs: Mapping[int, Any]) -> tuple[str, ...]:
    """The Dask keys of a step's resident inputs (Futures): part of its token, so a key
    names one computation over those very values (new arrays, new keys)."""
    return tuple(sorted(str(getattr(v[0], "key", v[0])) for v in inputs.values()))


def program_homes(mode: str, targets: Targets) -> tuple[Any, ...]:
    """Direct dispatch: the worker addresses a step's programs are built for (part of its
    token: after a worker was replaced, the step built again gets new keys)."""
    if mode != "direct":
        return ()
    return tuple(sorted((str(k), str(v)) for k, v in targets.addresses.items()))


@without_gc
def build(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
          options: Options, client: Any = None) -> Build:
    """Build one step of `fn` on `args`: the `Build` holds the graph and output keys."""
    model = trace_model(fn, args, kwargs, options, client)
    trace = model.trace
    targets, inputs = targets_and_inputs(trace, model.stages, client, options)
    devices = targets.devices()
    home = home_stages(trace)
    mode = resolve_dispatch(options.dispatch, client, targets) if options.pipelined \
        else "scheduler"
    token = step_token(trace, options.token(), tuple(sorted(model.batch)),
                       *model.batch.values(), mode, input_keys(inputs),
                       program_homes(mode, targets))

    def grad_keys(grads: Mapping[int, str]) -> list[Any]:
        return [jax.tree_util.tree_map(
            lambda v: OutKey(grads[v.node]) if isinstance(v, Traced) and v.node in grads
            else None, a, is_leaf=lambda x: x is None) for a in model.diff_args]

    if options.pipelined:
        direct = mode == "direct"
        binding = None
        if direct and templates.enabled():
            # compile once, run many: the same structure on the same workers binds the
            # lowered graph of an earlier step to this step's token, batch and parameters
            binding = Binding(
                templates.template_key(
                    trace, inputs, options.token(), tuple(sorted(model.batch)), mode,
                    program_homes(mode, targets), dict(targets.of),
                    dask.config.get("dagdiff", {}), _returned(model),
                    templates.sharing({n: _key_of(v[0]) for n, v in inputs.items()})),
                values=model.batch, refs={n: v[0] for n, v in inputs.items()},
                inputs={make_key("input", trace.nodes[i].path or "x", i, token): i
                        for i in model.batch},
                held={_key_of(f): n for n, (f, _) in inputs.items()})

        def lowered() -> StepTasks:
            dsk, stage_of, priority, (pg,) = lower_replicas(
                model, options, targets, client, [token], p=trace.num_stages or 1,
                batch=lambda r: model.batch, inputs=lambda r: inputs, home=home,
                aux=model.aux, devices=devices)
            keys = (OutKey(pg.loss_key), _aux_outputs(pg.aux_keys, model.aux),
                    grad_keys(pg.grad_keys))
            outs = frozenset(k for k in jax.tree_util.tree_leaves(keys)
                             if isinstance(k, OutKey))
            return StepTasks(dsk, stage_of, priority, keys, outs)

        graph, (lk, ak, gk) = compile_step(token, targets, direct, binding, lowered)
        freeze_heap(client)
        return Build(model, options, targets, graph, (lk, _aux_outputs(ak, model.aux), gk),
                     token, mode)
    low = lower(trace, model.plan, token, inputs=inputs, devices=devices,
                fuse_seeded=True)
    keys = (OutKey(select(low, trace, model.loss, "loss", token)),
            jax.tree_util.tree_map(
                lambda v: OutKey(select(low, trace, v, "aux", token))
                if isinstance(v, Traced) else v, model.aux),
            grad_keys(low.grad_keys))
    for node, key in low.data_keys.items():
        low.stage_of[key] = home.get(node)
    graph = assemble(low.dsk, low.stage_of, targets, token)
    freeze_heap(client)
    return Build(model, options, targets, graph, keys, token, mode)


def _key_of(ref: Any) -> str:
    """The Dask key of a Future (or of a key given as such)."""
    return str(getattr(ref, "key", ref))

