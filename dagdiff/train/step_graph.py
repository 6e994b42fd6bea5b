"""A Trainer step's graph: the traced model per replica and microbatch, the all-reduce of the
gradients and the optax updates, lowered (or bound to an earlier step's template)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import dask
import jax

from ..build import (
    Model,
    program_homes,
    replace_stages,
)
from ..cluster.targets import Targets
from ..core.keys import make_key
from ..lowering import template as templates
from ..lowering.graph import OutKey, assemble, assemble_direct
from ..lowering.memory import check_memory
from ..lowering.pipeline import lower_pipeline
from ..runtime.tasks import mean_task
from ..runtime.taskspec import DataNode, Task, TaskRef
from .allreduce import tree_allreduce
from .optimizer import ScaledOptimizer, update_task
from .state import TrainState

__all__ = ["StepModel", "StepGraph", "shard", "stage_address"]


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


class StepGraph:
    """The Trainer's lowering of one step (mixed into `Trainer`): per replica and
    microbatch the pipelined model, the all-reduce of the gradients, one optax update per
    (replica, group), bound to a template of an earlier step when one fits."""

    def _step_graph(self, model: "StepModel", state: TrainState, batch: Sequence[Any],
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
                values = {(r, node): shard(x, self.options.batch_axis, r, r_count)
                          for r in range(r_count) for node, x in zip(model.batch_nodes, leaves)}
                refs = {rg: v for rg, v in (state.placed or {}).items()}
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
        if self.client is not None and self.schedule is not None:
            # refuse a step whose gradient part alone cannot fit (optimizer state and the
            # update come on top: the check is a lower bound), once per template
            lstage = model.model.trace.nodes[model.model.loss.node].stage
            for r in range(r_count):
                check_memory(model.model.trace, self.schedule, m, self.options.remat, lstage,
                             {g: stage_address(targets, g + r * p) for g in range(p)},
                             self.client)
        for r in range(r_count):
            resident = {}
            for g, group in enumerate(model.groups):
                for pos, leaf in enumerate(group):
                    resident[model.param_nodes[leaf]] = (state_refs[(r, g)], pos)
            full = {node: shard(x, self.options.batch_axis, r, r_count)
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
        if not direct or not targets.on_workers:
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
                                                 targets.slots, inputs, refs,
                                                 out_keys)
            if tpl is not None:
                templates.store(tkey, tpl)
        return graph, out_keys, order

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
