"""`dd.Trainer`: training on the workers. Parameters and optimizer state live on their
stage's worker across steps; replicas train data-parallel with a tree all-reduce of the
gradients.

Each step lowers the (cached) traced model once per replica and microbatch; the
gradient of every parameter leaf is summed over microbatches on its stage's worker,
averaged over replicas by a pairwise tree of sums on the workers, and applied by one
optax update task per (replica, stage) whose result - the stage's new parameters and
optimizer state - stays on that worker as the next step's input. Only the loss comes
back to the client.

The Trainer in parts: its state (`train.state`), one step's graph (`train.step_graph`),
what happens after a lost worker (`train.restoring`, on `train.recovery`'s records and
tasks) and the fit loop (`train.fit`); this module holds the user-facing class.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

import dask
import jax
import numpy as np
import optax

from ..build import (
    Options,
    Source,
    freeze_heap,
    inbox_for,
    stage_workers,
    submit,
    to_delayed,
    trace_model,
)
from ..cluster.info import (
    current_client,
    seen_slots,
)
from ..cluster.targets import Targets, resolve_targets
from ..core.forms import ModelForm, lower_args
from ..core.tracer import home_stages
from ..errors import (ArgumentError, CheckpointError, LostStateError, MicrobatchError,
                      PlacementError, TrainerError)
from ..extras import available, require
from ..runtime.tasks import snapshot_batch
from .fit import FitRun, NoBar
from .optimizer import check_per_stage
from .recovery import Placement, Recovery, StepLoss
from .restoring import Restoring
from .state import NOT_INITIALIZED, TrainState
from .step_graph import StepGraph, StepModel, stage_address


__all__ = ["Trainer", "TrainState"]

log = logging.getLogger(__name__)

class Trainer(StepGraph, Restoring):
    """Train `loss_fn(params, *batch)` with an optax optimizer on a Dask cluster.

    ``microbatches``/``schedule`` pipeline each replica over its stages (see
    `dd.value_and_grad`); ``replicas=r`` trains r copies on disjoint worker groups
    (replica i's stage s runs on slot ``i * p + s``), each on 1/r of the batch, with
    gradients all-reduced before the update. ``client=None`` uses the current
    distributed client, or else runs on the local threads scheduler. ``dispatch`` and
    ``remat`` (what each stage keeps for its backward): as in `dd.value_and_grad`
    (pipelined steps on a cluster default to "direct").

    The optimizer runs on each stage's worker, on that stage's parameters (a list of
    their leaves). One whose updates then differ from its updates of the whole model (a
    global-norm clip, noise drawn for the whole tree) fails the first step with an
    `OptimizerError` (checked once on small stand-ins); ``per_stage_optimizer=True``
    accepts it per stage. ``clip_global_norm=c`` scales every stage's gradients to the
    global norm c at most before the optimizer, the norm over all stages, as
    ``optax.chain(optax.clip_by_global_norm(c), optimizer)`` does in one process.

    ``recover=True`` (the default) makes training survive a lost worker: every state has
    a second copy on another worker (another replica's; with one replica, a copy of each
    stage's state goes to another worker once `copy_every` steps and `copy_interval`
    seconds have passed since the last copy: a recovery runs the steps since again; the
    default interval, None, is 20 times what sending the whole state takes at the rate
    measured on the development machine, so that copies cost ~5% at most), `fit`
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
                 max_retries: int = 3, copy_every: int = 10,
                 copy_interval: float | None = None,
                 remat: str | Mapping[int, str] | None = None,
                 clip_global_norm: float | None = None,
                 per_stage_optimizer: bool = False) -> None:
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
        #: apply the optimizer to each stage's parameters alone even where its updates
        #: then differ from the whole model's (checked on the first step otherwise)
        self.per_stage_optimizer = bool(per_stage_optimizer)
        if clip_global_norm is not None and (
                not isinstance(clip_global_norm, (int, float))
                or isinstance(clip_global_norm, bool) or not clip_global_norm > 0):
            raise ArgumentError(f"Trainer: clip_global_norm must be a number > 0 (or None), "
                                f"got {clip_global_norm!r}")
        #: the gradients of every stage are scaled to this global norm at most before the
        #: optimizer (``optax.clip_by_global_norm``'s arithmetic, across stages)
        self.clip_global_norm = None if clip_global_norm is None else float(clip_global_norm)
        self.options = Options.make("dd.Trainer", argnums=0, microbatches=microbatches,
                                    schedule=schedule, batch_argnums=batch_argnums,
                                    batch_axis=batch_axis, stages=stages, placement=placement,
                                    fuse=fuse, dispatch=dispatch, remat=remat)
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or max_retries < 0:
            raise ArgumentError(f"Trainer: max_retries must be an int >= 0, got {max_retries!r}")
        if not isinstance(copy_every, int) or isinstance(copy_every, bool) or copy_every < 1:
            raise ArgumentError(f"Trainer: copy_every must be an int >= 1, got {copy_every!r}")
        if copy_interval is not None and (
                not isinstance(copy_interval, (int, float)) or isinstance(copy_interval, bool)
                or not copy_interval >= 0):
            raise ArgumentError(f"Trainer: copy_interval must be seconds >= 0 (0: every "
                                f"copy_every steps; None: from the state's size), got "
                                f"{copy_interval!r}")
        self.copy_every = copy_every
        #: seconds at least between two copies (None: `Restoring.copy_seconds`' estimate)
        self.copy_interval = None if copy_interval is None else float(copy_interval)
        #: (step, time.monotonic()) of the newest copy sent (`Restoring._to_copy`)
        self._copied: tuple[int, float] = (0, float("-inf"))
        self._state_bytes: int | None = None      # parameters + optimizer state
        #: whether states keep what recovery needs (the ``recover=`` option)
        self.recovering = bool(recover)
        self.max_retries = max_retries
        #: every failure `fit` recovered from (see `dagdiff.train.recovery.Recovery`)
        self.recoveries: list[Recovery] = []
        #: each change of where stages run (`dagdiff.train.recovery.Placement`): a stage
        #: moved to a live worker after its own was lost, or back on its own slot
        self.placements: list[Placement] = []
        self._moved: dict[int, tuple[str, str]] = {}
        self._own: dict[int, str] = {}            # stage -> its own slot, as last placed
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
        self._cache: dict[Any, StepModel] = {}
        #: parameter groupings the optimizer was checked on (`check_per_stage`)
        self._checked: set[tuple[tuple[int, ...], ...]] = set()
        #: fit(window="auto")'s choice per (batch signature, seconds aimed at): a later fit
        #: of such batches starts with it instead of timing its first steps again
        self._windows: dict[tuple[Any, float], int] = {}
        #: where the newest steps' state values come from (`import_locally`): Future key
        #: -> the program that exports it, for the next step's program on that worker
        self._sources: dict[str, Source] = {}
        #: the parameters' structure and leaf shapes and dtypes `init` last took
        self._signature: Any = None

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
        signature = (self._treedef, tuple((tuple(np.shape(x)), str(x.dtype)) for x in leaves))
        if signature != self._signature:
            # another model (other leaves or shapes: a re-run cell with a changed model):
            # what was traced, checked and timed for the old one does not hold for it
            self._cache.clear()
            self._checked.clear()
            self._windows.clear()
            self._sources.clear()
            self._signature = signature
        self._template = list(leaves)
        self._state_bytes = None
        state = TrainState(0, params=tuple(leaves), owner=self._ref, signature=signature)
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
        """(parameter leaves, optimizer state per group) of `state`, concrete; a value
        lost with its worker (scaled away or killed after `fit`) comes from its copy, or
        is made again as `recover` makes it."""
        if state.signature is not None and state.signature != self._signature:
            raise CheckpointError(
                f"this state (step {state.step}) was made for another model than the one "
                "this Trainer was last initialised with (trainer.init was called again); "
                "call trainer.init with that model's parameters to read it")
        if not state.is_placed:
            if state.groups is None or state.opt_leaves is None:
                return list(state.params or ()), []
            opts = [self._opt_from_leaves(state, g) for g in range(len(state.groups))]
            return list(state.params or ()), opts
        ngroups = len(state.groups or ())
        if self.client is None:
            parts = [state.placed[(0, g)] for g in range(ngroups)]
        else:
            try:
                whole = self._whole(state)
            except LostStateError:
                if state.lineage is None:         # nothing to make it again from
                    raise
                # its values and its copies were lost (a worker killed before the copies
                # landed): make it again through the steps since a state that survives
                whole = self.recover(state)
            try:
                parts = self.client.gather([whole.placed[(0, g)] for g in range(ngroups)])
            except Exception:
                # a worker killed just before (the scheduler had not noticed when the
                # state was checked): Dask ran the lost step's program again, which
                # cannot run alone; make the state again as `recover` does (from the
                # copies, or through its steps since the newest state that has them)
                if not self._gone(state):
                    raise
                whole = self.recover(state)
                parts = self.client.gather([whole.placed[(0, g)] for g in range(ngroups)])
            state = whole
        leaves: list[Any] = [None] * sum(len(g) for g in state.groups or ())
        opts = []
        for g, part in enumerate(parts):
            for pos, leaf in enumerate(state.groups[g]):
                leaves[leaf] = part[pos]
            opts.append(part[len(state.groups[g])])
        return leaves, opts

    def _check_leaves(self, state: TrainState) -> None:
        """Raise a CheckpointError when a state not made by this trainer's `init` (a
        `dd.load`ed one) holds parameters of other shapes than the model `init` was given:
        it would train the state's shapes and drop the model's."""
        if state.params is None or not self._template:
            return
        got = [(tuple(np.shape(x)), str(x.dtype)) for x in state.params]
        want = [(tuple(np.shape(x)), str(x.dtype)) for x in self._template]
        if got == want:
            return
        if len(got) != len(want):
            what = f"{len(got)} parameter leaves where the model has {len(want)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            what = (f"parameter leaf {i} is {got[i][1]}{list(got[i][0])} where the model's is "
                    f"{want[i][1]}{list(want[i][0])}")
        raise CheckpointError(
            f"this state does not fit the model the Trainer was initialised with: {what}. "
            "Was it saved from another model? Call trainer.init with parameters of the "
            "checkpoint's model (or load the checkpoint that belongs to this one)")

    def _opt_from_leaves(self, state: TrainState, g: int) -> Any:
        assert state.groups is not None and state.params is not None
        group_params = [state.params[i] for i in state.groups[g]]
        template = self.optimizer.init(group_params)
        if state.opt_leaves is None:
            return template
        want = jax.tree_util.tree_leaves(template)
        got = list(state.opt_leaves[g])
        if len(got) != len(want) or any(np.shape(a) != np.shape(b) for a, b in zip(got, want)):
            raise CheckpointError(
                f"this state's optimizer state of parameter group {g} has {len(got)} leaves "
                f"of shapes {[list(np.shape(x)) for x in got][:4]}"
                f", but this Trainer's optimizer makes {len(want)} of shapes "
                f"{[list(np.shape(x)) for x in want][:4]}: was it saved with another "
                "optimizer (e.g. adam, resumed with sgd)? Resume with the optimizer it was "
                "saved with")
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), got)

    # --- tracing and placement ----------------------------------------------------------
    @staticmethod
    def _batch_key(batch: Sequence[Any]) -> Any:
        """A batch's signature: its structure, and each leaf's shape and dtype."""
        avals = tuple((tuple(np.shape(x)), str(x.dtype)) if hasattr(x, "shape") else x
                      for x in jax.tree_util.tree_leaves(batch))
        return (jax.tree_util.tree_structure(batch), avals)

    def _model(self, batch: Sequence[Any]) -> "StepModel":
        """Trace once per batch signature: the model and its parameter groups (stages)."""
        r, m = self.replicas, self.microbatches
        key = self._batch_key(batch)
        hit = self._cache.get(key)
        if hit is not None and not hit.stale():
            return hit
        if self._treedef is None:
            raise TrainerError(NOT_INITIALIZED)
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
        p = model.trace.num_stages or 1
        group_of_stage: dict[int, int] = {}
        groups: list[list[int]] = []
        for i, node in enumerate(param_nodes):
            st = home.get(node.index)
            st = 0 if st is None else st
            if st not in group_of_stage:
                group_of_stage[st] = len(groups)
                groups.append([])
            groups[group_of_stage[st]].append(i)
        prints = {id(n.spec.layer): (n.spec.layer, n.spec.layer.fingerprint)
                  for n in model.trace.nodes if n.kind == "call"}
        out = StepModel(model, home, [n.index for n in param_nodes],
                     [n.index for n in batch_nodes], tuple(tuple(g) for g in groups),
                     [st for st, _ in sorted(group_of_stage.items(), key=lambda kv: kv[1])], p,
                     tuple(prints.values()))
        if out.groups not in self._checked:
            check_per_stage(self.optimizer, self._template, out.groups, out.group_stage,
                            compare=not self.per_stage_optimizer, treedef=self._treedef)
            self._checked.add(out.groups)
        self._cache[key] = out
        return out

    def _place(self, state: TrainState, model: "StepModel") -> TrainState:
        """Put each group's parameters + optimizer state on its stage's worker(s)."""
        if state.groups is not None and state.groups != model.groups:
            raise ArgumentError("this state's parameter groups do not match the model's stages "
                                f"({state.groups} vs {model.groups}); was it saved from another "
                                "model or stage layout?")
        self._check_leaves(state)
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
                addr = stage_address(targets, model.group_stage[g] + r * model.p)
                placed[(r, g)] = self._scatter(value, addr)
                if addr is not None:
                    where[(r, g)] = addr
        return TrainState(state.step, groups=model.groups, placed=placed, owner=self._ref,
                          backup=values if self.recovering else None, where=where,
                          signature=self._signature)

    def _scatter(self, value: Any, addr: str | None) -> Any:
        return self.client.scatter(   # a list: one Future for the whole tuple
            [value], workers=[addr] if addr is not None else None, hash=False)[0]

    def _targets(self, model: "StepModel", timeout: float = 300.0) -> Targets:
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
        to a live worker after its own was lost, back once its replacement joined, or
        out to a worker that joined the cluster (a slot never seen before: the stages
        spread over more workers)."""
        now = dict(targets.moved)
        own = {s: now[s][0] if s in now else t for s, t in targets.of.items()
               if isinstance(t, str)} if targets.slots else {}
        joined = {s: (self._own[s], t) for s, t in own.items()
                  if s in self._own and self._own[s] != t}
        if own:
            self._own = own
        if now == self._moved and not joined:
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
        if joined:
            log.warning("dagdiff: from step %d, %s (a worker joined)", step,
                        "; ".join(f"stage {s} runs on {to} instead of {was}"
                                  for s, (was, to) in sorted(joined.items())))
        self.placements.append(Placement(
            step, tuple((s, own, to) for s, (own, to) in sorted(now.items())),
            tuple((s, was, to) for s, (was, to) in sorted(joined.items()))))

    # --- one step -----------------------------------------------------------------------
    def step(self, state: TrainState, *batch: Any) -> tuple[TrainState, Any]:
        """Submit one training step; returns (new state, loss) without waiting (loss is a
        Future on a cluster; a concrete scalar on the local scheduler)."""
        batch = snapshot_batch(batch)   # a loader may refill its NumPy buffer meanwhile
        pre = self._prepare(state, batch)
        freeze_heap(self.client)
        box = None
        if self.client is None:
            values = dask.compute(*to_delayed(pre.graph, pre.out_keys), scheduler="threads")
        else:
            # the loss is pushed to the client's inbox where it is open to every worker
            box = inbox_for(self.client) if pre.direct else None
            if box is not None and box.ready(pre.workers):
                box.expect([str(pre.out_keys[0])])
            else:
                box = None
            values = submit(self.client, pre.graph, pre.out_keys)
        lineage = self._lineage(pre.state, batch)
        loss = values[0]
        if self.client is not None:
            loss = StepLoss(loss.key, self.client, pre.state.step, pre.workers)
            if box is not None:
                loss.take_pushed(box)
        return self._finish(pre, loss, values[1:], lineage), loss

    def fit(self, batches: Iterable[Sequence[Any]], steps: int | None = None,
            progress: bool | None = None, state: TrainState | None = None,
            params: Any = None, window: int | str = "auto"
            ) -> tuple[TrainState, list[float]]:
        """Run `steps` steps (default: all batches) from `state` (default: the latest state
        of this trainer, from `init` or `step`; or `init(params)` when given), submitting
        ahead. Returns (state, losses). `progress`: a tqdm bar with the loss (True; the
        default None shows one when tqdm, the ``progress`` extra, is installed).
        `window`: steps submitted as one Dask computation (one program task per worker
        for them all, their losses as one output: `dagdiff.train.window`), two windows in
        flight; larger windows cost Dask less per step, and a failure runs the whole
        window again. "auto" (the default) times the first steps and makes a window span
        about 0.5 s (dask config ``dagdiff.fit.window-seconds``), at most 64 steps: short
        steps share windows, steps longer than that go one by one (`fit.AutoWindow`); a
        later fit of batches of the same shapes starts with that choice. Steps that cannot
        share one (dispatch="scheduler") go one by one.

        A step that fails because a worker was lost (or restarted) runs again at once on
        the live workers (the lost worker's stages on a survivor until its replacement
        joins: `Recovery.moved`, `placements`), from the state before it with the lost
        stage's values taken from another replica or their copy, copied again to a second
        live worker first (``recover=True``, at most `max_retries` times
        per step): `fit` returns what an undisturbed run returns. Each recovery is in
        `trainer.recoveries`. Any other error is raised as it is, once the steps before
        it ended: the last finished state becomes the trainer's latest (a window holding a
        batch that cannot be a step runs its batches one by one first)."""
        if not (window == "auto" if isinstance(window, str) else
                isinstance(window, int) and not isinstance(window, bool) and window >= 1):
            raise ArgumentError(f"Trainer.fit: window must be an int >= 1 or 'auto', got "
                                f"{window!r}")
        if isinstance(batches, TrainState):
            raise ArgumentError("Trainer.fit(batches, ...): the first argument is the batches; "
                                "pass the state as a keyword: trainer.fit(batches, state=state)")
        if steps is not None and not (isinstance(steps, int) and not isinstance(steps, bool)
                                      and steps >= 0):
            raise ArgumentError(f"Trainer.fit: steps must be an int >= 0 or None, got "
                                f"{type(steps).__name__} {steps!r:.60}")
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
               else NoBar())
        return FitRun(self, state, bar, window).run(batches, steps)
