"""A Trainer step's graph: the traced model per replica and microbatch, the all-reduce of the
gradients and the optax updates, lowered (or bound to an earlier step's template)."""
from __future__ import annotations

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
    compile_step,
    lower_replicas,
    program_homes,
    templates,
    without_gc,
)
from ..cluster.targets import Targets
from ..core.keys import make_key
from ..runtime.tasks import mean_task
from ..runtime.taskspec import DataNode, Task, TaskRef
from .allreduce import tree_allreduce
from .optimizer import ScaledOptimizer, update_task
from .state import TrainState

__all__ = ["Prepared", "StepModel", "StepGraph", "shard", "stage_address"]


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
        leaves = self._batch_leaves(model, batch)
        order = [(r, g) for r in range(r_count) for g in range(len(model.groups))]
        tokens = [f"{token[:12]}{r:04x}" for r in range(r_count)]
        values = {(r, node): shard(x, self.options.batch_axis, r, r_count)
                  for r in range(r_count) for node, x in zip(model.batch_nodes, leaves)}
        loss_key = make_key("loss", "step", state.step, token)
        placed = dict(state.placed or {})
        binding = None
        if direct and self.client is not None and templates.enabled():
            binding = Binding(
                templates.template_key(
                    trace, {}, "trainer", self._uid, self.options.token(), r_count, m, p,
                    model.groups, tuple(sorted(placed)), program_homes("direct", targets),
                    dict(targets.of), dask.config.get("dagdiff", {}),
                    templates.sharing({rg: str(v.key) for rg, v in placed.items()})),
                values=values, refs=placed,
                inputs={make_key("input", trace.nodes[n].path or "x", n, tokens[r]): (r, n)
                        for r in range(r_count) for n in model.batch_nodes},
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

            def resident(r: int) -> dict[int, tuple[Any, int]]:
                return {model.param_nodes[leaf]: (state_refs[(r, g)], pos)
                        for g, group in enumerate(model.groups)
                        for pos, leaf in enumerate(group)}

            pdsk, pstage, priority, parts = lower_replicas(
                model.model, self.options, targets, self.client, tokens, p=p,
                batch=lambda r: {n: values[(r, n)] for n in model.batch_nodes},
                inputs=resident, home=model.home, held=self._opt_bytes(model))
            dsk.update(pdsk)
            stage_of.update(pstage)
            summed = tree_allreduce(dsk, stage_of, [pg.grad_keys for pg in parts],
                                    model.param_nodes, model.home, p, token)
            scaled = ScaledOptimizer(self.optimizer, r_count, f"{self._uid}-r{r_count}")
            updates: dict[tuple[int, int], str] = {}
            for r, g in order:
                stage = model.group_stage[g] + r * p
                k = make_key("update", f"g{g}", g, token, stage, r)
                grads = [TaskRef(summed[model.param_nodes[i]]) for i in model.groups[g]]
                ref = state_refs[(r, g)]
                dsk[k] = Task(k, update_task, scaled, len(model.groups[g]),
                              TaskRef(ref) if isinstance(ref, str) else ref, *grads)
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
            size = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                       for a in jax.tree_util.tree_leaves(opt) if hasattr(a, "shape"))
            out[model.group_stage[g]] = out.get(model.group_stage[g], 0) + size
        return out

    def _batch_leaves(self, model: "StepModel", batch: Sequence[Any]) -> list[Any]:
        args = (None, *batch)
        out = []
        for i in model.model.batch_argnums:
            out.extend(x for x in jax.tree_util.tree_leaves(args[i]) if hasattr(x, "shape"))
        return out


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
