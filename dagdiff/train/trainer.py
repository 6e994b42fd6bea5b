"""`dd.Trainer`: training on the workers. Parameters and optimizer state live on their
stage's worker across steps; replicas train data-parallel with a tree all-reduce of the
gradients.

Each step lowers the (cached) traced model once per replica and microbatch; the
gradient of every parameter leaf is summed over microbatches on its stage's worker,
averaged over replicas by a pairwise tree of sums on the workers, and applied by one
optax update task per (replica, stage) whose result - the stage's new parameters and
optimizer state - stays on that worker as the next step's input. Only the loss comes
back to the client.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

import dask
import jax
import numpy as np
import optax
from dask.base import tokenize

from ..build import (
    Model,
    Options,
    program_homes,
    replace_stages,
    resolve_dispatch,
    step_token,
    trace_model,
)
from ..cluster.info import (
    check_open,
    current_client,
    forget_workers,
    lost_workers,
    may_be_a_lost_worker,
    seen_slots,
)
from ..cluster.targets import Targets, resolve_targets
from ..core.forms import ModelForm, lower_args
from ..core.keys import make_key
from ..core.tracer import home_stages
from ..errors import (ArgumentError, LostStateError, MicrobatchError, PlacementError,
                      TrainerError, WorkerLostError)
from ..extras import available, require
from ..lowering import template as templates
from ..lowering.graph import OutKey, assemble, assemble_direct, to_delayed
from ..lowering.pipeline import lower_pipeline, stage_workers
from ..runtime.direct import RESOURCE_SHARE
from ..runtime.tasks import mean_task
from ..runtime.taskspec import DataNode, Task, TaskRef
from .allreduce import tree_allreduce
from .optimizer import ScaledOptimizer, update_task
from .recovery import (Lineage, Placement, Recovery, StepLoss, copy_task, lost_values,
                       restore)


__all__ = ["Trainer", "TrainState"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainState:
    """Where training stands: the step count and, per (replica, group), the stage's
    parameters + optimizer state - a Future on its worker once placed, or concrete
    leaves (after `Trainer.init` without a batch, or `dd.load`) to be placed on the
    next step. `groups` lists the parameter-leaf indices of each group (stage)."""

    step: int
    params: tuple[Any, ...] | None = None            # concrete leaves (unplaced)
    opt_leaves: tuple[tuple[Any, ...], ...] | None = None  # concrete, per group (unplaced)
    groups: tuple[tuple[int, ...], ...] | None = None
    placed: Mapping[tuple[int, int], Any] | None = None  # (replica, group) -> Future/tuple
    owner: Any = dataclasses.field(default=None, repr=False, compare=False)  # weakref
    #: a second copy of each placed value, for recovery: a Future on another worker, or
    #: the concrete value (the initial state, kept on the client)
    backup: Mapping[tuple[int, int], Any] | None = dataclasses.field(
        default=None, repr=False, compare=False)
    #: the worker address each placed value was made on
    where: Mapping[tuple[int, int], str] | None = dataclasses.field(
        default=None, repr=False, compare=False)
    #: how to make this state again after a lost worker (`Trainer.recover`)
    lineage: Lineage | None = dataclasses.field(default=None, repr=False, compare=False)
    #: the loss of the step that made this state (a `StepLoss` Future on a cluster)
    loss: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def trainer(self) -> "Trainer | None":
        """The Trainer that made this state (if it still exists)."""
        return self.owner() if self.owner is not None else None

    @property
    def is_placed(self) -> bool:
        return self.placed is not None


class Trainer:
    """Train `loss_fn(params, *batch)` with an optax optimizer on a Dask cluster.

    ``microbatches``/``schedule`` pipeline each replica over its stages (see
    `dd.value_and_grad`); ``replicas=r`` trains r copies on disjoint worker groups
    (replica i's stage s runs on slot ``i * p + s``), each on 1/r of the batch, with
    gradients all-reduced before the update. ``client=None`` uses the current
    distributed client, or else runs on the local threads scheduler. ``dispatch``: as in
    `dd.value_and_grad` (pipelined steps on a cluster default to "direct").

    ``recover=True`` (the default) makes training survive a lost worker: every state has
    a second copy on another worker (another replica's; with one replica, every
    `copy_every`-th step sends a copy of each stage's state to the next worker), `fit`
    runs a step that lost a worker again from the newest state it can restore, running
    the finished steps since again from their batches (at most `max_retries` times per
    step), and lists what it did in `recoveries`; `step` restores a state whose values
    were lost before using it, when a copy of them exists.
    """

    def __init__(self, loss_fn: Callable[..., Any], optimizer: optax.GradientTransformation,
                 microbatches: int = 1, schedule: Any = None, replicas: int = 1,
                 client: Any = None, *,
                 stages: int | str | Any = None, placement: Mapping[int, Any] | None = None,
                 fuse: bool | None = None, batch_argnums: Sequence[int] | None = None,
                 batch_axis: int = 0, dispatch: str | None = None, recover: bool = True,
                 max_retries: int = 3, copy_every: int = 10) -> None:
        for label, value in (("replicas", replicas), ("microbatches", microbatches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ArgumentError(f"Trainer: {label} must be a positive int, got {value!r}")
        if not (callable(getattr(optimizer, "init", None))
                and callable(getattr(optimizer, "update", None))):
            raise ArgumentError(
                f"Trainer: optimizer must be an optax GradientTransformation (with init and "
                f"update), got {type(optimizer).__name__}; e.g. optax.adam(1e-3)")
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.options = Options.make("dd.Trainer", argnums=0, microbatches=microbatches,
                                    schedule=schedule, batch_argnums=batch_argnums,
                                    batch_axis=batch_axis, stages=stages, placement=placement,
                                    fuse=fuse, dispatch=dispatch)
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise ArgumentError(f"Trainer: max_retries must be an int >= 0, got {max_retries!r}")
        if not isinstance(copy_every, int) or isinstance(copy_every, bool) or copy_every < 1:
            raise ArgumentError(f"Trainer: copy_every must be an int >= 1, got {copy_every!r}")
        self.copy_every = copy_every
        #: whether states keep what recovery needs (the ``recover=`` option)
        self.recovering = bool(recover)
        self.max_retries = max_retries
        #: every failure `fit` recovered from (see `dagdiff.train.recovery.Recovery`)
        self.recoveries: list[Recovery] = []
        #: each change of where stages run (`dagdiff.train.recovery.Placement`): a stage
        #: moved to a live worker after its own was lost, or back on its own slot
        self.placements: list[Placement] = []
        self._moved: dict[int, tuple[str, str]] = {}
        self.microbatches = microbatches
        self.schedule = self.options.schedule
        self.replicas = replicas
        self.client = client if client is not None else current_client()
        self._treedef: Any = None
        self._form: ModelForm | None = None
        self._traced_fn: Callable[..., Any] = loss_fn
        self._template: list[Any] = []
        self._last: TrainState | None = None
        self._ref = weakref.ref(self)
        self._uid = uuid.uuid4().hex[:8]   # task keys of different trainers never collide
        self._cache: dict[Any, _Model] = {}

    # --- state ------------------------------------------------------------------------
    def init(self, params: Any, *example_batch: Any) -> TrainState:
        """Initial state. With an example batch the parameters and optimizer state are
        placed on their stage workers now; otherwise on the first step."""
        # a Flax NNX / Equinox module trains as its params() dict; the rest is held fixed
        self._traced_fn, (params,), forms = lower_args(self.loss_fn, (params,), (0,))
        self._form = forms.get(0)
        if self._form is not None and not self._form.params():
            raise ArgumentError(f"Trainer: the {self._form.cls} module has no float "
                                "parameters to train")
        leaves, self._treedef = jax.tree_util.tree_flatten(params)
        for i, x in enumerate(leaves):
            if not hasattr(x, "dtype") or not jax.dtypes.issubdtype(x.dtype, np.inexact):
                raise ArgumentError(f"Trainer parameters must be float arrays; leaf {i} is "
                                    f"{type(x).__name__} {getattr(x, 'dtype', '')}. Keep "
                                    "constants out of the params pytree (close over them).")
        self._template = list(leaves)
        state = TrainState(0, params=tuple(leaves), owner=self._ref)
        if example_batch:
            state = self._place(state, self._model(example_batch))
        self._last = state
        return state

    def params(self, state: TrainState) -> Any:
        """The parameters as a concrete pytree (gathered from replica 0's workers); for
        a Flax NNX or Equinox model, a new module of the user's class holding them."""
        leaves, _ = self.gather(state)
        params = jax.tree_util.tree_unflatten(self._treedef, leaves)
        return params if self._form is None else self._form.rebuild(params)

    def opt_state(self, state: TrainState) -> list[Any]:
        """The optimizer state of each group (stage), concrete."""
        _, opt = self.gather(state)
        return opt

    def gather(self, state: TrainState) -> tuple[list[Any], list[Any]]:
        if not state.is_placed:
            if state.groups is None or state.opt_leaves is None:
                return list(state.params or ()), []
            opts = [self._opt_from_leaves(state, g) for g in range(len(state.groups))]
            return list(state.params or ()), opts
        ngroups = len(state.groups or ())
        parts = [state.placed[(0, g)] for g in range(ngroups)]
        if self.client is not None:
            parts = self.client.gather(parts)
        leaves: list[Any] = [None] * sum(len(g) for g in state.groups or ())
        opts = []
        for g, part in enumerate(parts):
            for pos, leaf in enumerate(state.groups[g]):
                leaves[leaf] = part[pos]
            opts.append(part[len(state.groups[g])])
        return leaves, opts

    def _opt_from_leaves(self, state: TrainState, g: int) -> Any:
        assert state.groups is not None and state.params is not None
        group_params = [state.params[i] for i in state.groups[g]]
        template = self.optimizer.init(group_params)
        if state.opt_leaves is None:
            return template
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template),
                                            list(state.opt_leaves[g]))

    # --- tracing and placement ----------------------------------------------------------
    def _model(self, batch: Sequence[Any]) -> "_Model":
        """Trace once per batch signature: the model and its parameter groups (stages)."""
        r, m = self.replicas, self.microbatches
        avals = tuple((tuple(np.shape(x)), str(x.dtype)) if hasattr(x, "shape") else x
                      for x in jax.tree_util.tree_leaves(batch))
        key = (jax.tree_util.tree_structure(batch), avals)
        if key in self._cache:
            return self._cache[key]
        if self._treedef is None:
            raise TrainerError("call Trainer.init(params) before Trainer.step")
        pavals = jax.tree_util.tree_unflatten(self._treedef, [
            jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in self._template])
        try:
            model = trace_model(self._traced_fn, (pavals, *batch), {}, self.options, self.client,
                                splits=r * m)
        except MicrobatchError as e:
            raise MicrobatchError(f"{e} (replicas={r} x microbatches={m})") from None
        model = dataclasses.replace(model, batch={})   # the values come with each step
        home = home_stages(model.trace)
        inputs = [n for n in model.trace.nodes if n.kind != "call"]
        n_params = len(self._template)
        param_nodes = inputs[:n_params]
        batch_nodes = inputs[n_params:]
        p = max(model.stages) + 1 if model.stages else 1
        group_of_stage: dict[int, int] = {}
        groups: list[list[int]] = []
        for i, node in enumerate(param_nodes):
            st = home.get(node.index)
            st = 0 if st is None else st
            if st not in group_of_stage:
                group_of_stage[st] = len(groups)
                groups.append([])
            groups[group_of_stage[st]].append(i)
        out = _Model(model, home, [n.index for n in param_nodes],
                     [n.index for n in batch_nodes], tuple(tuple(g) for g in groups),
                     [st for st, _ in sorted(group_of_stage.items(), key=lambda kv: kv[1])], p)
        self._cache[key] = out
        return out

    def _place(self, state: TrainState, model: "_Model") -> TrainState:
        """Put each group's parameters + optimizer state on its stage's worker(s)."""
        if state.groups is not None and state.groups != model.groups:
            raise ArgumentError("this state's parameter groups do not match the model's stages "
                                f"({state.groups} vs {model.groups}); was it saved from another "
                                "model or stage layout?")
        base = dataclasses.replace(state, groups=model.groups)
        placed: dict[tuple[int, int], Any] = {}
        values: dict[tuple[int, int], Any] = {}
        where: dict[tuple[int, int], str] = {}
        targets = self._targets(model)
        for g, leaves in enumerate(model.groups):
            value = (*[base.params[i] for i in leaves], self._opt_from_leaves(base, g))
            for r in range(self.replicas):
                values[(r, g)] = value
                if self.client is None:
                    placed[(r, g)] = value
                    continue
                addr = _address(targets, model.group_stage[g] + r * model.p)
                placed[(r, g)] = self._scatter(value, addr)
                if addr is not None:
                    where[(r, g)] = addr
        return TrainState(state.step, groups=model.groups, placed=placed, owner=self._ref,
                          backup=values if self.recovering else None, where=where)

    def _scatter(self, value: Any, addr: str | None) -> Any:
        return self.client.scatter(   # a list: one Future for the whole tuple
            [value], workers=[addr] if addr is not None else None, hash=False)[0]

    def _targets(self, model: "_Model", timeout: float = 300.0) -> Targets:
        """Where each stage runs. A stage whose worker was lost runs on a live one until
        its replacement joins (`Targets.moved`); only when no worker of the cluster is
        running does it wait, when recovering, up to `timeout` s for one to start."""
        stages = set(range(model.p * self.replicas))
        default = (stage_workers(self.schedule, model.p, self.replicas)
                   if self.schedule is not None else None)
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            try:
                return resolve_targets(stages, self.client, dict(self.options.placement),
                                       default)
            except PlacementError:
                if (not self.recovering or self.client is None
                        or not seen_slots(self.client) or time.monotonic() >= deadline):
                    raise
                if not waited:
                    log.warning("dagdiff: no worker of the cluster is running; waiting up to "
                                "%g s for one to start", timeout)
                    waited = True
                time.sleep(0.25)

    def _note_moves(self, step: int, targets: Targets) -> None:
        """Log (and keep in `placements`) each change of where stages run: a stage moved
        to a live worker after its own was lost, or back once its replacement joined."""
        now = dict(targets.moved)
        if now == self._moved:
            return
        away = {s: v for s, v in now.items() if self._moved.get(s) != v}
        back = sorted(s for s in self._moved if s not in now)
        self._moved = now
        if away:
            log.warning("dagdiff: from step %d, %s (lost) until its worker is back", step,
                        "; ".join(f"stage {s} runs on {to} instead of {own}"
                                  for s, (own, to) in sorted(away.items())))
        if back:
            log.warning("dagdiff: from step %d, stage(s) %s run on their own slot again",
                        step, ", ".join(map(str, back)))
        self.placements.append(Placement(step, tuple(
            (s, own, to) for s, (own, to) in sorted(now.items()))))

    # --- one step -----------------------------------------------------------------------
    def step(self, state: TrainState, *batch: Any) -> tuple[TrainState, Any]:
        """Submit one training step; returns (new state, loss) without waiting (loss is a
        Future on a cluster; a concrete scalar on the local scheduler)."""
        if self._treedef is None:
            raise TrainerError("call Trainer.init(params) before Trainer.step")
        if not isinstance(state, TrainState):
            raise ArgumentError(
                f"Trainer.step takes the TrainState from Trainer.init (or the previous step), "
                f"got {type(state).__name__}: state = trainer.init(params); "
                "state, loss = trainer.step(state, x, t)")
        if self.client is not None:
            check_open(self.client)
        model = self._model(batch)
        if not state.is_placed:
            state = self._place(state, model)
        elif self.client is not None:
            t0 = time.monotonic()
            state, done = self._restored(state, model)
            if done:
                self.recoveries.append(Recovery(
                    state.step, tuple(sorted({(state.where or {}).get((r, g), "?")
                                              for r, g, _ in done})),
                    done, 0, time.monotonic() - t0, "the step's input state was lost"))
        r_count, m, p = self.replicas, self.microbatches, model.p
        targets = self._targets(model)
        if targets.kind == "slots":
            self._note_moves(state.step, targets)
        direct = (self.schedule is not None
                  and resolve_dispatch(self.options.dispatch, self.client, targets) == "direct")
        # a key names one computation: this trainer's step from these very state values
        # (their Futures' keys) on this batch's content, so a step from another state or
        # on another batch never shares keys with this one, and the same step again does
        token = step_token(model.model.trace, ("step", self.options.token()), state.step,
                           self._uid, _state_identity(state), _batch_token(batch),
                           program_homes("direct" if direct else "", targets))
        graph, out_keys, order = self._step_graph(model, state, batch, token, targets, direct)
        outs = to_delayed(graph, out_keys)
        if self.client is None:
            values = dask.compute(*outs, scheduler="threads")
        else:
            values = self.client.compute(outs)
        loss = values[0]
        placed = dict(zip(order, values[1:]))
        lineage = self._lineage(state, batch)
        where = {}
        backup = None
        if self.client is not None:
            where = {(r, g): a for (r, g) in placed
                     if (a := _address(targets, model.group_stage[g] + r * p)) is not None}
            loss = StepLoss(loss.key, self.client, state.step, set(where.values()))
            if self.recovering:
                copy = self._to_copy(model, targets, state.step + 1)
                if copy:
                    backup = self._copies({rg: placed[rg] for rg in copy}, model, targets,
                                          token)
        self._last = TrainState(state.step + 1, groups=model.groups, placed=placed,
                                owner=self._ref, backup=backup, where=where,
                                lineage=lineage if self.client is not None else None,
                                loss=loss)
        return self._last, loss

    def _step_graph(self, model: "_Model", state: TrainState, batch: Sequence[Any],
                    token: str, targets: Targets, direct: bool
                    ) -> tuple[Any, list[OutKey], list[tuple[int, int]]]:
        """The step's graph, its output keys (the loss, then each new state value) and
        the (replica, group) of each new state value. With direct dispatch on a cluster,
        bound to the template of an earlier step of this trainer with the same structure
        and workers (`lowering.template`), or lowered and kept as one."""
        r_count, m, p = self.replicas, self.microbatches, model.p
        leaves = self._batch_leaves(model, batch)
        tkey = None
        if direct and self.client is not None and templates.enabled():
            tkey = templates.template_key(
                model.model.trace, {}, "trainer", self._uid, self.options.token(), r_count,
                m, p, model.groups, tuple(sorted(state.placed or {})),
                program_homes("direct", targets), dict(targets.of),
                dask.config.get("dagdiff", {}),
                templates.sharing({rg: str(v.key) for rg, v in (state.placed or {}).items()}))
            tpl = templates.lookup(tkey)
            if tpl is not None:
                values = {(r, node): _shard(x, self.options.batch_axis, r, r_count)
                          for r in range(r_count) for node, x in zip(model.batch_nodes, leaves)}
                refs = {rg: str(v.key) for rg, v in (state.placed or {}).items()}
                lk = make_key("loss", "step", state.step, token)
                graph, keys = tpl.bind(token, values, refs, {tpl.keys[0]: lk})
                order = [(r, g) for r in range(r_count) for g in range(len(model.groups))]
                return graph, keys, order
        dsk: dict[str, Any] = {}
        stage_of: dict[str, int | None] = {}
        priority: dict[str, int] = {}
        state_refs: dict[tuple[int, int], Any] = {}
        for (r, g), value in state.placed.items():  # type: ignore[union-attr]
            if self.client is None:
                k = make_key("state", f"g{g}", g, token, model.group_stage[g] + r * p, None)
                dsk[k] = DataNode(k, value)
                stage_of[k] = model.group_stage[g] + r * p
                state_refs[(r, g)] = k
            else:
                state_refs[(r, g)] = value
        replica_loss, replica_grads = [], []
        for r in range(r_count):
            resident = {}
            for g, group in enumerate(model.groups):
                for pos, leaf in enumerate(group):
                    resident[model.param_nodes[leaf]] = (state_refs[(r, g)], pos)
            full = {node: _shard(x, self.options.batch_axis, r, r_count)
                    for node, x in zip(model.batch_nodes, leaves)}
            home = {k: (v + r * p if v is not None else None) for k, v in model.home.items()}
            pg = lower_pipeline(replace_stages(model.model.trace, r * p), model.model.plan,
                                f"{token[:12]}{r:04x}", microbatches=m,
                                schedule=self.schedule, batch=full,
                                axis=self.options.batch_axis, inputs=resident, home=home,
                                loss=model.model.loss, stage_offset=r * p)
            dsk.update(pg.dsk)
            stage_of.update(pg.stage_of)
            priority.update(pg.priority)
            replica_loss.append(pg.loss_key)
            replica_grads.append(pg.grad_keys)
            loss_stage = pg.stage_of.get(pg.loss_key)
        summed = tree_allreduce(dsk, stage_of, replica_grads, model.param_nodes, model.home, p,
                                token)
        scaled = ScaledOptimizer(self.optimizer, r_count, f"{self._uid}-r{r_count}")
        new_placed: dict[tuple[int, int], str] = {}
        for r in range(r_count):
            for g, group in enumerate(model.groups):
                stage = model.group_stage[g] + r * p
                k = make_key("update", f"g{g}", g, token, stage, r)
                grads = [TaskRef(summed[model.param_nodes[i]]) for i in group]
                state_ref = state_refs[(r, g)]
                ref = TaskRef(state_ref) if isinstance(state_ref, str) else state_ref
                dsk[k] = Task(k, update_task, scaled, len(group), ref, *grads)
                stage_of[k] = stage
                new_placed[(r, g)] = k
        lk = make_key("loss", "step", state.step, token)
        dsk[lk] = Task(lk, mean_task, *map(TaskRef, replica_loss))
        # one replica: on its loss's worker, which holds the value (nothing moves)
        stage_of[lk] = loss_stage if r_count == 1 else None
        # direct dispatch: the new parameters come straight from their stage's program
        # (the next step's program on that worker reads them without a cross-worker
        # Dask edge); the loss waits for the whole step
        order = [(r, g) for r in range(r_count) for g in range(len(model.groups))]
        out_keys = [OutKey(lk)] + [OutKey(new_placed[rg]) for rg in order]
        if not direct or targets.kind not in ("slots", "workers"):
            graph = assemble(dsk, stage_of, targets, token, priority=priority,
                             direct={lk} if direct else None, outputs=set(new_placed.values()))
            return graph, out_keys, order
        graph, plan, prio, where = assemble_direct(
            dsk, stage_of, targets, token, priority=priority, direct={lk},
            outputs=set(new_placed.values()))
        if tkey is not None:
            trace = model.model.trace
            inputs = {make_key("input", trace.nodes[n].path or "x", n, f"{token[:12]}{r:04x}"):
                      (r, n) for r in range(r_count) for n in model.batch_nodes}
            refs = {str(v.key): rg for rg, v in (state.placed or {}).items()}
            tpl = templates.StepTemplate.capture(token, "dagdiff", plan, prio, where,
                                                 targets.kind == "slots", inputs, refs,
                                                 out_keys)
            if tpl is not None:
                templates.store(tkey, tpl)
        return graph, out_keys, order

    def _lineage(self, before: TrainState, batch: Sequence[Any]) -> Lineage | None:
        """How the state a step from `before` on `batch` makes can be made again: from
        `before` when it survives any one lost worker (replicas, copies, or the client's
        initial values), else from `before`'s own start, through the batches since."""
        if not self.recovering:
            return None
        if not before.is_placed or before.backup or self._has_copy(before):
            return Lineage(dataclasses.replace(before, lineage=None, loss=None),
                           (tuple(batch),))
        if before.lineage is not None:
            return Lineage(before.lineage.start, before.lineage.batches + (tuple(batch),))
        return None

    # --- after a lost worker ------------------------------------------------------------
    def recover(self, state: TrainState) -> TrainState:
        """A usable state in place of `state`: `state` itself when every value is still
        held; else, when `state`'s step failed or a value was lost with its worker, the
        same state made again - from the newest state that survives one lost worker
        (another replica's values, their copy, or the client's initial values) by running
        the steps since again, waiting for a lost slot's replacement as `fit` does. Its
        step's new loss is ``state.loss``. Raises `LostStateError` when nothing holds what
        was lost (resume from a checkpoint). The usual loop::

            state, loss = trainer.step(state, x, t)
            try:
                print(float(loss.result()))
            except dd.WorkerLostError:
                state = trainer.recover(state)      # the step, run again
                print(float(state.loss.result()))
        """
        if not isinstance(state, TrainState):
            raise ArgumentError(f"Trainer.recover takes a TrainState, got {type(state).__name__}")
        if self.client is None or not state.is_placed:
            return state
        check_open(self.client)
        t0, wall = time.monotonic(), time.time()
        forget_workers(self.client)
        if self._usable(state):
            return state
        lineage = state.lineage
        if lineage is None or not lineage.batches:
            model = next(iter(self._cache.values()), None)
            if model is None:
                raise TrainerError("Trainer.recover: this trainer never ran a step")
            restored, done = self._restored(state, model, ask=True)
            self.recoveries.append(Recovery(state.step, self._gone(state), done, 0,
                                            time.monotonic() - t0, "recover", wall))
            self._last = restored
            return restored
        model = self._model(lineage.batches[0])
        start = lineage.start
        targets = self._targets(model)            # the live workers: no waiting
        done: tuple[tuple[int, int, str], ...] = ()
        if start.is_placed:
            start, done = self._restored(start, model, ask=True)
            start = self._protect(start, model)   # a second copy before it is used
        moved = tuple((s, own, to) for s, (own, to) in sorted(targets.moved.items()))
        now = start
        for b in lineage.batches:
            now, _ = self.step(now, *b)
        log.warning("dagdiff: Trainer.recover made step %d's state again from step %d "
                    "(%d step(s) run again)", state.step, start.step, len(lineage.batches))
        self.recoveries.append(Recovery(state.step - 1, self._gone(state), done,
                                        len(lineage.batches) - 1, time.monotonic() - t0,
                                        "recover", wall, moved))
        return now

    def _usable(self, state: TrainState) -> bool:
        """Whether every value of `state` is held by a worker (or still being computed by
        a step that did not fail)."""
        assert state.placed is not None
        futures = [v for v in state.placed.values() if hasattr(v, "status")]
        if any(f.status in ("error", "cancelled", "lost") for f in futures):
            return False
        if getattr(state.loss, "worker_lost", False):
            return False
        if any(f.status == "pending" for f in futures):
            return True
        return not lost_values(self.client, state.placed)

    def _gone(self, state: TrainState) -> tuple[str, ...]:
        try:
            return lost_workers(self.client, set((state.where or {}).values()), wait=0.0)
        except Exception:                         # noqa: BLE001 - only for the record
            return ()

    def _to_copy(self, model: "_Model", targets: Targets, step: int
                 ) -> list[tuple[int, int]]:
        """The (replica, group) values of the state a step makes that get a copy: with one
        replica every `copy_every`-th step's; with more, those of a group whose replicas
        all run on one worker (e.g. after a loss put them together), every step."""
        groups = range(len(model.groups))
        if self.replicas == 1:
            return [(0, g) for g in groups] if step % self.copy_every == 0 else []
        out = []
        for g in groups:
            stages = [model.group_stage[g] + r * model.p for r in range(self.replicas)]
            if len({targets.target(st) for st in stages}) < 2:
                out.extend((r, g) for r in range(self.replicas))
        return out

    def _copies(self, placed: Mapping[tuple[int, int], Any], model: "_Model",
                targets: Targets, token: str,
                held: Mapping[str, Collection[str]] | None = None
                ) -> dict[tuple[int, int], Any]:
        """A copy of each value of `placed` on another worker: the next one after its
        stage's (slots in order), sent after the step's update, off its critical path;
        none on a one-worker cluster. `held` (key -> addresses holding it, a restored
        value that may not be on its stage's worker): the stage's worker when it does not
        hold the value, else the next worker that does not."""
        slots = targets.kind == "slots"
        ring = sorted(targets.addresses) if slots else sorted(set(targets.of.values()))
        address = dict(targets.addresses) if slots else {a: a for a in ring}
        out = {}
        for (r, g), fut in placed.items():
            stage = model.group_stage[g] + r * model.p
            home = targets.target(stage)
            if home not in ring or len(ring) < 2:
                continue
            i = ring.index(home)
            order = ring[i + 1:] + ring[:i]
            if held is not None:
                have = set(held.get(fut.key, ()))
                order = [w for w in [home, *order] if address[w] not in have] or order
            other = order[0]
            where = ({"resources": {other: RESOURCE_SHARE}} if slots
                     else {"workers": [other]})
            out[(r, g)] = self.client.submit(
                copy_task, fut, key=make_key("backup", f"g{g}", g, token, stage, r), **where)
        return out

    def _protect(self, state: TrainState, model: "_Model") -> TrainState:
        """`state` (just recovered after a loss) with every value on two live workers:
        a value only one worker holds gets a fresh copy on another (its stage's worker,
        else the next), so that another loss right after this one loses nothing."""
        assert state.placed is not None
        targets = self._targets(model)
        futures = [v for v in state.placed.values() if hasattr(v, "key")]
        held = self.client.who_has(futures) if futures else {}
        single = {rg: v for rg, v in state.placed.items()
                  if hasattr(v, "key") and len(held.get(v.key, ())) < 2}
        # a new key whenever the holders differ (a copy made before this loss is not one)
        token = tokenize("protect", _state_identity(state),
                         sorted((str(k), sorted(v)) for k, v in held.items()),
                         ensure_deterministic=False)[:16]
        copies = self._copies(single, model, targets, token, held)
        if set(single) - set(copies):
            return state                      # one live worker: nowhere to copy to
        # a value two workers hold is its own copy (dagdiff keeps the replicas: no AMM
        # ReduceReplicas); restore finds it while either of them lives
        backup = {rg: copies.get(rg, v) for rg, v in state.placed.items()}
        return dataclasses.replace(state, backup=backup)

    def _restored(self, state: TrainState, model: "_Model", ask: bool = False
                  ) -> tuple[TrainState, tuple[tuple[int, int, str], ...]]:
        """`state` with any value lost with its worker replaced from a replica or copy
        (LostStateError when none holds it); `state` itself when nothing is lost. `ask`:
        ask the scheduler which values it still has (after a loss, before the client's
        futures hear of it), instead of reading the futures' status."""
        assert state.placed is not None
        bad = [f for f in state.placed.values() if getattr(f, "status", "finished") == "error"]
        if not bad and getattr(state.loss, "worker_lost", False):
            bad = [state.loss]                # its step failed: its values are not its own
        if bad and not ask:
            why = (f"{type(bad[0].exception()).__name__}: {str(bad[0].exception())[:300]}"
                   if bad[0].status == "error" else "a worker it ran on was lost")
            raise TrainerError(
                f"this state (step {state.step}) is the result of a step that failed ({why}); "
                "after a lost worker, `state = trainer.recover(state)` makes it again, else "
                "step from the state before it (trainer.fit does both for you)")
        if not ask and all(getattr(f, "status", "finished") in ("finished", "pending")
                           for f in state.placed.values()):
            return state, ()
        if not self.recovering:
            raise LostStateError(
                f"part of this state (step {state.step}) was lost with its worker, and the "
                "Trainer has recover=False; resume from a checkpoint (dd.load)")
        kept = state.backup or {}
        copies = {rg: v for rg, v in kept.items() if hasattr(v, "key")}
        targets = self._targets(model)

        def rescatter(r: int, g: int) -> Any:     # the initial state: the client has it
            return self._scatter(kept[(r, g)],
                                 _address(targets, model.group_stage[g] + r * model.p))

        concrete = bool(kept) and not copies
        placed, done = restore(self.client, state.placed, copies, model.group_stage, model.p,
                               state.where, rescatter if concrete else None)
        if done:
            log.warning("dagdiff: Trainer restored %s of step %d after a lost worker",
                        ", ".join(f"replica {r} group {g} from {src}" for r, g, src in done),
                        state.step)
        return dataclasses.replace(state, placed=placed), done

    def _batch_leaves(self, model: "_Model", batch: Sequence[Any]) -> list[Any]:
        args = (None, *batch)
        out = []
        for i in model.model.batch_argnums:
            out.extend(x for x in jax.tree_util.tree_leaves(args[i]) if hasattr(x, "shape"))
        return out

    def fit(self, batches: Iterable[Sequence[Any]], steps: int | None = None,
            progress: bool | None = None, state: TrainState | None = None,
            params: Any = None) -> tuple[TrainState, list[float]]:
        """Run `steps` steps (default: all batches) from `state` (default: the latest state
        of this trainer, from `init` or `step`; or `init(params)` when given), submitting
        ahead. Returns (state, losses). `progress`: a tqdm bar with the loss (True; the
        default None shows one when tqdm, the ``progress`` extra, is installed).

        A step that fails because a worker was lost (or restarted) runs again at once on
        the live workers (the lost worker's stages on a survivor until its replacement
        joins: `Recovery.moved`, `placements`), from the state before it with the lost
        stage's values taken from another replica or their copy, copied again to a second
        live worker first (``recover=True``, at most `max_retries` times
        per step): `fit` returns what an undisturbed run returns. Each recovery is in
        `trainer.recoveries`. Any other error is raised as it is."""
        if params is not None and state is None:
            state = self.init(params)
        if state is None:
            state = self._last
        if state is None:
            raise TrainerError("fit needs a state: call trainer.init(params) first, or pass "
                               "state= or params=")
        total = steps
        if total is None and hasattr(batches, "__len__"):
            total = len(batches)  # type: ignore[arg-type]
        if progress is None:
            progress = available("tqdm")
        tqdm = require("tqdm.auto", "Trainer.fit(progress=True)").tqdm if progress else None
        bar = (tqdm(total=total, desc="train", unit="step") if tqdm is not None
               else _NoBar())
        pending: list[_InFlight] = []
        losses: list[float] = []
        finished = state                              # the last state whose step ended
        # where to go back to: `base`, a state with copies, and per finished step since,
        # its batch and (only when it has copies) its state; other states are not kept
        base = state
        history: list[tuple[tuple[Any, ...], TrainState | None]] = []
        retries = 0

        def take_one() -> None:
            nonlocal finished, retries, base
            entry = pending[0]
            try:
                value = float(_result(entry.loss))
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:                    # noqa: BLE001 - classified below
                recover(e)
                return
            pending.pop(0)
            losses.append(value)
            finished = entry.after
            if self.recovering:
                history.append((entry.batch,
                                entry.after if self._has_copy(entry.after) else None))
                anchors = [j for j, (_, st) in enumerate(history) if st is not None]
                if len(anchors) > 2:                  # keep the two newest copies
                    base = history[anchors[-2]][1]
                    del history[:anchors[-2] + 1]
            retries = 0
            if entry.recovery is not None:
                self.recoveries.append(dataclasses.replace(
                    entry.recovery, seconds=time.monotonic() - entry.recovery.seconds))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            bar.update(1)

        def recover(error: Exception) -> None:
            nonlocal retries, base
            entry = pending[0]
            if not self.recovering or self.client is None or retries >= self.max_retries:
                raise error
            t0, wall = time.monotonic(), time.time()
            gone = (error.workers if isinstance(error, WorkerLostError)  # the loss found them
                    else lost_workers(self.client, set((entry.after.where or {}).values()),
                                      wait=10.0 if may_be_a_lost_worker(error) else 0.0))
            if not gone:
                raise error                           # the model failed, not a worker
            retries += 1
            forget_workers(self.client)
            log.warning("dagdiff: step %d failed after losing worker(s) %s (%s: %s); "
                        "running it again", entry.before.step, ", ".join(gone),
                        type(error).__name__, str(error)[:200])
            if entry.recovery is not None:            # its retried step was lost too
                self.recoveries.append(dataclasses.replace(
                    entry.recovery, seconds=time.monotonic() - entry.recovery.seconds,
                    error=entry.recovery.error + " (the retried step was lost again: see "
                    "the next recovery)"))
            todo = [e.batch for e in pending]
            pending.clear()                           # let go of the failed steps' futures
            model = self._model(entry.batch)
            targets = self._targets(model)            # the live workers: no waiting
            start, replay, restored = self._recoverable(entry, base, history)
            if start.is_placed:
                # a second copy of what was restored, before anything depends on it; the
                # batches since `start` are what `base` needs from now on
                protected = self._protect(start, model)
                if protected is not start:
                    start = base = protected
                    history[:] = [(b, None) for b in replay]
            moved = tuple((s, own, to) for s, (own, to) in sorted(targets.moved.items()))
            now = start
            for b in replay:                          # finished steps, run again
                now, _ = self.step(now, *b)
            for i, b in enumerate(todo):
                after, loss = self.step(now, *b)
                rec = None
                if i == 0:
                    rec = Recovery(entry.before.step, gone, restored, len(replay), t0,
                                   f"{type(error).__name__}: {str(error)[:500]}", wall,
                                   moved)
                pending.append(_InFlight(loss, now, after, b, rec))
                now = after

        try:
            for i, batch in enumerate(batches):
                if steps is not None and i >= steps:
                    break
                if not isinstance(batch, (tuple, list)):
                    raise ArgumentError(
                        f"Trainer.fit takes an iterable of batches, each a tuple of the loss "
                        f"function's batch arguments (e.g. [(x0, t0), (x1, t1), ...]); batch "
                        f"{i} is a {type(batch).__name__}")
                if i == 0:
                    finished = base = self._with_copy(finished, batch)
                before = pending[-1].after if pending else finished
                try:
                    after, loss = self.step(before, *batch)
                except (LostStateError, TrainerError):
                    if not pending or not self.recovering:
                        raise
                    # the state this step starts from was lost (a worker went away) or
                    # failed before its own step ended: that step's failure goes through
                    # recovery first, and this step starts from the state it gives
                    while pending:
                        take_one()
                    before = finished
                    after, loss = self.step(before, *batch)
                pending.append(_InFlight(loss, before, after, tuple(batch)))
                while len(pending) > 2:  # keep two steps in flight
                    take_one()
            while pending:
                take_one()
        except KeyboardInterrupt:
            # Ctrl-C: keep the steps that already ended, let go of the others (released
            # futures stop their programs on the workers; this frame, kept alive by the
            # traceback, must not hold them), and make the last finished state this
            # trainer's latest
            while pending and getattr(pending[0].loss, "status", "finished") == "finished":
                take_one()
            pending.clear()
            history.clear()
            before = after = loss = None              # noqa: F841 - drop the in-flight futures
            self._last = finished
            bar.close()
            warnings.warn(f"Trainer.fit interrupted after {len(losses)} finished step(s); "
                          f"trainer.fit(...) goes on from step {finished.step} (the state "
                          "of the last finished step)", stacklevel=2)
            raise
        bar.close()
        self._last = finished
        if steps is not None and len(losses) < steps:
            warnings.warn(f"Trainer.fit: the batches ran out after {len(losses)} of "
                          f"steps={steps} steps; pass more batches (e.g. "
                          "itertools.cycle(batches)) to train longer", stacklevel=2)
        return finished, losses

    def _with_copy(self, state: TrainState, batch: Sequence[Any]) -> TrainState:
        """`state` with a copy of its values on other workers, when it is placed, has
        none, and the trainer recovers: where `fit` can go back to."""
        if (not self.recovering or self.client is None or not state.is_placed
                or self._has_copy(state) or state.backup):
            return state
        model = self._model(batch)
        token = tokenize(_state_identity(state), ensure_deterministic=False)[:16]
        assert state.placed is not None
        return dataclasses.replace(
            state, backup=self._copies(state.placed, model, self._targets(model), token))

    def _has_copy(self, state: TrainState) -> bool:
        """Whether every value of `state` has a second copy on another worker: another
        replica's on a different worker, or a copy step's."""
        backup, where = state.backup or {}, state.where or {}
        for r, g in state.placed or {}:
            if hasattr(backup.get((r, g)), "key"):
                continue
            if not any(where.get((r2, g2)) not in (None, where.get((r, g)))
                       for r2, g2 in where if g2 == g and r2 != r):
                return False
        return bool(state.placed)

    def _recoverable(self, entry: "_InFlight", base: TrainState,
                     history: list[tuple[tuple[Any, ...], TrainState | None]]
                     ) -> tuple[TrainState, list[tuple[Any, ...]],
                                tuple[tuple[int, int, str], ...]]:
        """The newest state that can be restored: the failed step's input, else the
        newest finished state with copies (every `copy_every` steps) or `base`, and the
        batches of the finished steps after it, to run again."""
        candidates: list[tuple[TrainState, list[tuple[Any, ...]]]] = [(entry.before, [])]
        for j in range(len(history) - 1, -1, -1):
            kept = history[j][1]
            if kept is not None:
                candidates.append((kept, [b for b, _ in history[j + 1:]]))
        candidates.append((base, [b for b, _ in history]))
        first: Exception | None = None
        for start, replay in candidates:
            if not start.is_placed:               # the first step: it is placed again
                return start, replay, ()
            model = self._model(entry.batch)
            try:
                restored, done = self._restored(start, model, ask=True)
            except LostStateError as e:
                log.debug("dagdiff: cannot restart from step %d: %s", start.step, e)
                first = first or e
                continue
            return restored, replay, done
        assert first is not None
        raise first


def _state_identity(state: TrainState) -> Any:
    """The Dask keys of a placed state's values (or the values, on the local scheduler)."""
    out = []
    for rg, v in sorted((state.placed or {}).items()):
        key = getattr(v, "key", None)
        out.append((rg, key if key is not None else _batch_token([v])))
    return tuple(out)


def _batch_token(batch: Any) -> str:
    """A content token of a step's batch (cached per jax array by dagdiff's tokenizer)."""
    return tokenize(*jax.tree_util.tree_leaves(batch), ensure_deterministic=False)


def _result(x: Any) -> Any:
    return x.result() if hasattr(x, "result") else x


def _shard(x: Any, axis: int, r: int, n: int) -> Any:
    if n == 1:
        return x
    size = x.shape[axis] // n
    index = [slice(None)] * x.ndim
    index[axis] = slice(r * size, (r + 1) * size)
    return x[tuple(index)]


def _address(targets: Targets, stage: int) -> str | None:
    """The worker address a stage runs on (None without a cluster)."""
    t = targets.target(stage)
    addr = targets.addresses.get(t) if targets.kind == "slots" else t
    return addr if isinstance(addr, str) else None


@dataclass(frozen=True)
class _InFlight:
    """A submitted step in `fit`: its loss, the states before and after it, its batch, and
    the recovery it is the retry of (`seconds` holds the failure's time until it ends)."""

    loss: Any
    before: TrainState
    after: TrainState
    batch: tuple[Any, ...]
    recovery: Recovery | None = None


class _NoBar:
    """What `fit` updates when no progress bar is shown."""

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class _Model:
    """A Trainer's traced model (per batch signature) and its parameter groups: group g
    holds the parameter leaves `groups[g]`, all read first on stage `group_stage[g]`."""

    model: Model
    home: Mapping[int, int | None]
    param_nodes: list[int]
    batch_nodes: list[int]
    groups: tuple[tuple[int, ...], ...]
    group_stage: list[int]
    p: int
