"""A Trainer step's graph: the traced model per replica and microbatch, the all-reduce of the
gradients and the optax updates, lowered (or bound to an earlier step's template)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import dask
import jax
import numpy as np

from ..build import (
    Binding,
    Model,
    OutKey,
    StepTasks,
    chain_steps,
    compile_step,
    lower_replicas,
    program_homes,
    push_loss,
    resolve_dispatch,
    step_token,
    templates,
    without_gc,
)
from ..cluster.info import check_open
from ..cluster.targets import Targets
from ..core.footprint import nbytes
from ..core.keys import make_key
from ..core.tracer import is_array
from ..errors import ArgumentError, CheckpointError, LostStateError, TrainerError
from ..runtime.tasks import mean_task, snapshot
from ..runtime.taskspec import DataNode, Task, TaskRef
from .allreduce import tree_allreduce
from .optimizer import ScaledOptimizer, norm_task, sumsq_task, update_task
from .recovery import Recovery
from .state import NOT_INITIALIZED, TrainState, batch_token, state_identity

__all__ = ["SOURCES_KEPT", "Prepared", "StepModel", "StepGraph", "shard", "stage_address"]

#: state values whose source program a Trainer remembers for the next step (`_chain`)
SOURCES_KEPT = 256


@dataclass(frozen=True)
class StepModel:
    """A Trainer's traced model (per batch signature) and its parameter groups: group g
    holds the parameter leaves `groups[g]`, all read first on stage `group_stage[g]`."""

    model: Model
    home: Mapping[int, int | None]
    param_nodes: list[int]
    batch_nodes: list[int]
    groups: tuple[tuple[int, ...], ...]
    group_stage: list[int]
    p: int
    #: (layer, its fingerprint when traced) of each layer call: a global a layer reads,
    #: changed since (a later notebook cell), makes the Trainer trace the model again
    prints: tuple[tuple[Any, str], ...] = ()

    def stale(self) -> bool:
        """Whether a layer of the model reads other values than when it was traced."""
        return any(layer.fingerprint != fp for layer, fp in self.prints)


@dataclass(frozen=True)
class Prepared:
    """A Trainer step built but not submitted: the state it starts from (placed), its
    model, targets, dispatch and token, its graph with the output keys (the loss, then
    the new state's values in `order`: (replica, group) pairs), and the worker address
    each new state value is made on."""

    state: TrainState
    model: StepModel
    targets: Targets
    direct: bool
    token: str
    graph: Any
    out_keys: list[Any]
    order: list[tuple[int, int]]
    where: dict[tuple[int, int], str]

    @property
    def workers(self) -> set[str]:
        """The workers the step runs on."""
        return set(self.where.values())


class StepGraph:
    """The Trainer's lowering of one step (mixed into `Trainer`): per replica and
    microbatch the pipelined model, the all-reduce of the gradients, one optax update per
    (replica, group), bound to a template of an earlier step when one fits."""

    @without_gc
    def _prepare(self, state: TrainState, batch: Sequence[Any]) -> Prepared:
        """A step's graph, built (and chained to the step before) but not submitted."""
        if self._treedef is None:
            raise TrainerError(NOT_INITIALIZED)
        if not isinstance(state, TrainState):
            raise ArgumentError(
                f"Trainer.step takes the TrainState from Trainer.init (or the previous step), "
                f"got {type(state).__name__}: state = trainer.init(params); "
                "state, loss = trainer.step(state, x, t)")
        if self.client is not None:
            check_open(self.client)
        gone = {id(c): c for f in (state.placed or {}).values()
                if (c := getattr(f, "client", None)) is not None and c is not self.client
                and getattr(c, "status", "running") in ("closing", "closed")}
        if gone:
            raise LostStateError(
                f"this state (step {state.step}) was held by a Client that is closed "
                f"({next(iter(gone.values()))!r}): its values went with it (Dask releases "
                "a closed client's data), no worker was lost. Go on from a checkpoint "
                "(dd.save before closing the client, then trainer.init(params) and "
                "trainer.fit(batches, state=dd.load(path))) or from parameters gathered "
                "before (trainer.params(state), then trainer.init)")
        if state.signature is not None and state.signature != self._signature:
            raise CheckpointError(
                f"this state (step {state.step}) was made for another model than the one "
                "this Trainer was last initialised with (other parameter leaves or shapes: "
                "trainer.init was called again, e.g. a re-run cell with a changed model). "
                "Go on from it with trainer.init(that model's parameters) first, or train "
                "the new model from the state trainer.init gave for it")
        if state.params is not None:
            self._check_leaves(state)             # a loaded checkpoint: before tracing
        model = self._model(batch)
        if not state.is_placed:
            state = self._place(state, model)
        elif self.client is not None:
            t0 = time.monotonic()
            try:
                state, done = self._restored(state, model)
            except LostStateError:
                lineage = state.lineage
                if lineage is None or not lineage.batches:
                    raise
                # no replica or copy holds what was lost, but the steps that made this
                # state are known: made again from the newest state that survives (a
                # step loop's or an interrupted fit's latest state, a worker lost since)
                state, done = self.recover(state), ()   # recover notes its Recovery
            if done:
                self.recoveries.append(Recovery(
                    state.step, tuple(sorted({(state.where or {}).get((r, g), "?")
                                              for r, g, _ in done})),
                    done, 0, time.monotonic() - t0, "the step's input state was lost"))
        targets = self._targets(model)
        if targets.slots:
            self._note_moves(state.step, targets)
        direct = (self.schedule is not None
                  and resolve_dispatch(self.options.dispatch, self.client, targets) == "direct")
        # a key names one computation: this trainer's step from these very state values
        # (their Futures' keys) on this batch's content, so a step from another state or
        # on another batch never shares keys with this one, and the same step again does;
        # and one task: its programs read the state values this trainer still knows the
        # source program of in place, the others as Dask dependencies (`_chain`)
        token = step_token(model.model.trace, ("step", self.options.token()), state.step,
                           self._uid, state_identity(state), batch_token(batch),
                           program_homes("direct" if direct else "", targets),
                           self._chained(state) if direct else ())
        graph, out_keys, order = self._step_graph(model, state, batch, token, targets, direct)
        if direct and self.client is not None:
            self._chain(graph, [str(k) for k in out_keys[1:]])
        where = {(r, g): a for (r, g) in order
                 if (a := stage_address(targets, model.group_stage[g] + r * model.p))
                 is not None} if self.client is not None else {}
        return Prepared(state, model, targets, direct, token, graph, list(out_keys), order,
                        where)

    def _finish(self, pre: Prepared, loss: Any, values: Sequence[Any],
                lineage: Any) -> TrainState:
        """The state a submitted step makes: its values (Futures, or concrete on the local
        scheduler), their copies when this step makes one, and how to make it again."""
        placed = dict(zip(pre.order, values))
        backup = None
        if self.client is not None and self.recovering:
            copy = self._to_copy(pre.model, pre.targets, pre.state.step + 1)
            if copy:
                backup = self._copies({rg: placed[rg] for rg in copy}, pre.model, pre.targets,
                                      pre.token)
        self._last = TrainState(pre.state.step + 1, groups=pre.model.groups, placed=placed,
                                owner=self._ref, backup=backup, where=dict(pre.where),
                                lineage=lineage if self.client is not None else None,
                                loss=loss, signature=pre.state.signature)
        return self._last

    def _chained(self, state: TrainState) -> tuple[tuple[str, str], ...]:
        """The state values whose source program this trainer remembers, and where it ran
        (what `_chain` reads in place)."""
        if self.client is None or not dask.config.get("dagdiff.direct.chain-steps", True):
            return ()
        keys = sorted(str(v.key) for v in (state.placed or {}).values() if hasattr(v, "key"))
        return tuple((k, self._sources[k].address) for k in keys if k in self._sources)

    def _chain(self, graph: Any, state_keys: Sequence[str]) -> None:
        """With direct dispatch: each program of this step reads the state values the
        previous step's program on its worker exported straight from it (no scheduler
        round trip between the two steps' programs: `chain_steps`), and this step's new
        state values are remembered for the next step (the newest `SOURCES_KEPT`). Dask
        config ``dagdiff.direct.chain-steps: false`` keeps them Dask dependencies."""
        self._sources.update(chain_steps(graph, self._sources, state_keys))
        while len(self._sources) > SOURCES_KEPT:
            del self._sources[next(iter(self._sources))]

    def _step_graph(self, model: "StepModel", state: TrainState, batch: Sequence[Any],
                    token: str, targets: Targets, direct: bool
                    ) -> tuple[Any, list[OutKey], list[tuple[int, int]]]:
        """The step's graph, its output keys (the loss, then each new state value) and
        the (replica, group) of each new state value: the build core's pipelined lowering
        of every replica (`compile_step`), extended with the all-reduce of the gradients,
        one optax update per (replica, group) and the mean loss. With direct dispatch on
        a cluster it is bound to the template of an earlier step of this trainer with the
        same structure and workers, or lowered and kept as one."""
        r_count, m, p = self.replicas, self.microbatches, model.p
        trace = model.model.trace
        leaves, split = self._batch_leaves(model, batch)
        # the arguments left out of batch_argnums: every microbatch of every replica
        # reads them whole (a dropout key, a constant), as dd.value_and_grad does
        whole = [n for n, s in zip(model.batch_nodes, split) if not s]
        order = [(r, g) for r in range(r_count) for g in range(len(model.groups))]
        tokens = [f"{token[:12]}{r:04x}" for r in range(r_count)]
        values = {(r, node): x if not s else shard(x, self.options.batch_axis, r, r_count)
                  for r in range(r_count)
                  for node, x, s in zip(model.batch_nodes, leaves, split)}
        input_keys = {(r, n): make_key("input", trace.nodes[n].path or "x", n, tokens[r])
                      for r in range(r_count) for n in model.batch_nodes}
        loss_key = make_key("loss", "step", state.step, token)
        placed = dict(state.placed or {})
        binding = None
        if direct and self.client is not None and templates.enabled():
            binding = Binding(
                templates.template_key(
                    trace, {}, "trainer", self._uid, self.options.token(), r_count, m, p,
                    self.clip_global_norm,
                    model.groups, tuple(sorted(placed)), program_homes("direct", targets),
                    dict(targets.of), dask.config.get("dagdiff", {}),
                    templates.sharing({rg: str(v.key) for rg, v in placed.items()})),
                values=values, refs=placed,
                inputs={k: rn for rn, k in input_keys.items()},
                held={str(v.key): rg for rg, v in placed.items()},
                rename=lambda keys: {keys[0]: loss_key})

        def lowered() -> StepTasks:
            dsk: dict[str, Any] = {}
            stage_of: dict[str, int | None] = {}
            state_refs: dict[tuple[int, int], Any] = {}
            for (r, g), value in placed.items():
                if self.client is None:
                    k = make_key("state", f"g{g}", g, token, model.group_stage[g] + r * p,
                                 None)
                    dsk[k] = DataNode(k, value)
                    stage_of[k] = model.group_stage[g] + r * p
                    state_refs[(r, g)] = k
                else:
                    state_refs[(r, g)] = value

            for r in range(r_count):
                for n in whole:                   # one value for all its microbatches
                    k = input_keys[(r, n)]
                    dsk[k] = DataNode(k, snapshot(values[(r, n)]))
                    h = model.home.get(n)
                    stage_of[k] = None if h is None else h + r * p

            def resident(r: int) -> dict[int, tuple[Any, int]]:
                out: dict[int, tuple[Any, int]] = {
                    model.param_nodes[leaf]: (state_refs[(r, g)], pos)
                    for g, group in enumerate(model.groups) for pos, leaf in enumerate(group)}
                out.update((n, (input_keys[(r, n)], -1)) for n in whole)
                return out

            pdsk, pstage, priority, parts = lower_replicas(
                model.model, self.options, targets, self.client, tokens, p=p,
                batch=lambda r: {n: values[(r, n)] for n in model.batch_nodes
                                 if n not in whole},
                inputs=resident, home=model.home, held=self._opt_bytes(model))
            dsk.update(pdsk)
            stage_of.update(pstage)
            summed = tree_allreduce(dsk, stage_of, [pg.grad_keys for pg in parts],
                                    model.param_nodes, model.home, p, token)
            clip = self.clip_global_norm
            scaled = ScaledOptimizer(self.optimizer, r_count, f"{self._uid}-r{r_count}", clip)
            norms: dict[int, Any] = {}
            if clip is not None:
                # the global norm of the (replica-averaged) gradients of every stage: a sum
                # of squares on each stage's worker, added on stage 0's; each replica
                # computes its own (their gradients are equal after the all-reduce)
                for r in range(r_count):
                    parts_r = []
                    for g, group in enumerate(model.groups):
                        stage = model.group_stage[g] + r * p
                        k = make_key("grad", f"sumsq_g{g}", g, token, stage, r)
                        dsk[k] = Task(k, sumsq_task, r_count,
                                      *(TaskRef(summed[model.param_nodes[i]]) for i in group))
                        stage_of[k] = stage
                        parts_r.append(TaskRef(k))
                    k = make_key("grad", "norm", 0, token, model.group_stage[0] + r * p, r)
                    dsk[k] = Task(k, norm_task, *parts_r)
                    stage_of[k] = model.group_stage[0] + r * p
                    norms[r] = TaskRef(k)
            updates: dict[tuple[int, int], str] = {}
            for r, g in order:
                stage = model.group_stage[g] + r * p
                k = make_key("update", f"g{g}", g, token, stage, r)
                grads = [TaskRef(summed[model.param_nodes[i]]) for i in model.groups[g]]
                ref = state_refs[(r, g)]
                extra = {"norm": norms[r]} if r in norms else {}
                dsk[k] = Task(k, update_task, scaled, len(model.groups[g]),
                              TaskRef(ref) if isinstance(ref, str) else ref, *grads, **extra)
                stage_of[k] = stage
                updates[(r, g)] = k
            dsk[loss_key] = Task(loss_key, mean_task, *(TaskRef(pg.loss_key) for pg in parts))
            # one replica: on its loss's worker, which holds the value (nothing moves)
            stage_of[loss_key] = parts[-1].stage_of.get(parts[-1].loss_key) \
                if r_count == 1 else None
            # direct dispatch: the new parameters come straight from their stage's
            # program (the next step's program on that worker reads them without a
            # cross-worker Dask edge); the loss waits for the whole step
            keys = [OutKey(loss_key)] + [OutKey(updates[rg]) for rg in order]
            return StepTasks(dsk, stage_of, priority, keys, frozenset({loss_key}),
                             frozenset(updates.values()))

        graph, keys = compile_step(token, targets, direct, binding, lowered)
        if direct:
            push_loss(graph, str(keys[0]))     # the loss goes to the waiting client
        return graph, keys, order

    def _opt_bytes(self, model: "StepModel") -> dict[int, float]:
        """Per stage: the bytes of its groups' optimizer state (held for the whole step,
        beside what the memory model counts; from the optimizer's init on the groups'
        abstract parameters)."""
        out: dict[int, float] = {}
        for g, group in enumerate(model.groups):
            avals = [jax.ShapeDtypeStruct(np.shape(self._template[i]), self._template[i].dtype)
                     for i in group]
            try:
                opt = jax.eval_shape(self.optimizer.init, avals)
            except Exception:                     # noqa: BLE001 - only an estimate
                continue
            size = sum(nbytes(a) for a in jax.tree_util.tree_leaves(opt)
                       if hasattr(a, "shape"))
            out[model.group_stage[g]] = out.get(model.group_stage[g], 0) + size
        return out

    def _batch_leaves(self, model: "StepModel", batch: Sequence[Any]
                      ) -> tuple[list[Any], list[bool]]:
        """The value of each of the step's batch input nodes (the array leaves of the
        arguments after the parameters, in the trace's order), and whether it is split
        into microbatches (its argument is in batch_argnums) or read whole."""
        leaves: list[Any] = []
        split: list[bool] = []
        nums = set(model.model.batch_argnums)
        for i, arg in enumerate(batch, start=1):
            xs = [x for x in jax.tree_util.tree_leaves(arg) if is_array(x)]
            leaves.extend(xs)
            split.extend([i in nums] * len(xs))
        return leaves, split


def shard(x: Any, axis: int, r: int, n: int) -> Any:
    if n == 1:
        return x
    size = x.shape[axis] // n
    index = [slice(None)] * x.ndim
    index[axis] = slice(r * size, (r + 1) * size)
    return x[tuple(index)]


def stage_address(targets: Targets, stage: int) -> str | None:
    """The worker address a stage runs on (None without a cluster)."""
    return targets.address(stage)
