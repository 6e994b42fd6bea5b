"""Training on the workers: parameters and optimizer state live on their stage's worker
across steps; replicas train data-parallel with a tree all-reduce of the gradients.

Each step lowers the (cached) traced model once per replica and microbatch; the
gradient of every parameter leaf is summed over microbatches on its stage's worker,
averaged over replicas by a pairwise tree of sums on the workers, and applied by one
optax update task per (replica, stage) whose result - the stage's new parameters and
optimizer state - stays on that worker as the next step's input. Only the loss comes
back to the client.
"""
from __future__ import annotations

import dataclasses
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from .taskspec import DataNode, Task, TaskRef

from .api import (OutKey, _argnames, _argnums, _check_loss, build_graph, check_dispatch,
                  current_client, prepare, program_homes, resolve_dispatch, to_delayed,
                  trace_call)
from .backward import build_backward
from .errors import ArgumentError, CheckpointError, MicrobatchError
from .keys import make_key
from .lower import trace_token
from .pipeline import lower_pipeline, microbatch_avals, resolve_schedule
from .placement import home_stages, resolve_targets
from .tasks import mean_task, sum_task

__all__ = ["Trainer", "TrainState", "save", "load"]


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

    @property
    def trainer(self) -> "Trainer | None":
        """The Trainer that made this state (if it still exists)."""
        return self.owner() if self.owner is not None else None

    @property
    def is_placed(self) -> bool:
        return self.placed is not None


def _update_task(optimizer: "_Scaled", n: int, state: Any, *grads: Any, **after: Any) -> tuple:
    """One optax step for one stage's parameter leaves: (new leaves..., new opt state)."""
    params, opt_state = list(state[:n]), state[n]
    new, new_state = optimizer.compiled()(params, opt_state, list(grads))
    return (*jax.block_until_ready(new), new_state)


# jitted optimizer steps per (trainer, replica count), kept on each worker: the optimizer
# arrives pickled with every task (optax transforms are closures, re-created on each
# unpickling), so a cache keyed by the object would compile on every step
_COMPILED_UPDATES: dict[str, Any] = {}
_UPDATES_LOCK = threading.Lock()


def _pack_task(*values: Any) -> tuple:
    return tuple(values)


class Trainer:
    """Train `loss_fn(params, *batch)` with an optax optimizer on a Dask cluster.

    ``microbatches``/``schedule`` pipeline each replica over its stages (see
    `dd.value_and_grad`); ``replicas=r`` trains r copies on disjoint worker groups
    (replica i's stage s runs on slot ``i * p + s``), each on 1/r of the batch, with
    gradients all-reduced before the update. ``client=None`` uses the current
    distributed client, or else runs on the local threads scheduler. ``dispatch``: as in
    `dd.value_and_grad` (pipelined steps on a cluster default to "direct").
    """

    def __init__(self, loss_fn: Callable[..., Any], optimizer: Any, microbatches: int = 1,
                 schedule: Any = None, replicas: int = 1, client: Any = None, *,
                 stages: int | str | None = None, placement: Mapping[int, Any] | None = None,
                 fuse: bool | None = None, batch_argnums: Sequence[int] | None = None,
                 batch_axis: int = 0, dispatch: str | None = None) -> None:
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
        self.microbatches = microbatches
        pipelined = schedule is not None or microbatches > 1
        self.schedule = resolve_schedule(schedule) if pipelined else None
        self.replicas = replicas
        self.client = client if client is not None else current_client()
        self.stages = stages
        self.placement = dict(placement or {})
        self.fuse = (microbatches > 1) if fuse is None else fuse
        self.batch_argnums = batch_argnums
        self.batch_axis = batch_axis
        self.dispatch = check_dispatch(dispatch)
        self._treedef: Any = None
        self._template: list[Any] = []
        self._last: TrainState | None = None
        self._ref = weakref.ref(self)
        self._uid = uuid.uuid4().hex[:8]   # task keys of different trainers never collide
        self._cache: dict[Any, Any] = {}

    # --- state ------------------------------------------------------------------------
    def init(self, params: Any, *example_batch: Any) -> TrainState:
        """Initial state. With an example batch the parameters and optimizer state are
        placed on their stage workers now; otherwise on the first step."""
        leaves, self._treedef = jax.tree_util.tree_flatten(params)
        for i, x in enumerate(leaves):
            if not hasattr(x, "dtype") or not jax.dtypes.issubdtype(x.dtype, np.inexact):
                raise TypeError(f"Trainer parameters must be float arrays; leaf {i} is "
                                f"{type(x).__name__} {getattr(x, 'dtype', '')}. Keep "
                                "constants out of the params pytree (close over them).")
        self._template = list(leaves)
        state = TrainState(0, params=tuple(leaves), owner=self._ref)
        if example_batch:
            state = self._place(state, self._model(example_batch))
        self._last = state
        return state

    def params(self, state: TrainState) -> Any:
        """The parameters as a concrete pytree (gathered from replica 0's workers)."""
        leaves, _ = self._gather(state)
        return jax.tree_util.tree_unflatten(self._treedef, leaves)

    def opt_state(self, state: TrainState) -> list[Any]:
        """The optimizer state of each group (stage), concrete."""
        _, opt = self._gather(state)
        return opt

    def _gather(self, state: TrainState) -> tuple[list[Any], list[Any]]:
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
    def _model(self, batch: Sequence[Any]) -> Any:
        """Trace once per batch signature: the trace, backward plan and parameter groups."""
        r, m = self.replicas, self.microbatches
        avals = tuple((tuple(np.shape(x)), str(x.dtype)) if hasattr(x, "shape") else x
                      for x in jax.tree_util.tree_leaves(batch))
        key = (jax.tree_util.tree_structure(batch), avals)
        if key in self._cache:
            return self._cache[key]
        if self._treedef is None:
            raise RuntimeError("call Trainer.init(params) first")
        fname = getattr(self.loss_fn, "__name__", "loss_fn")
        pavals = jax.tree_util.tree_unflatten(self._treedef, [
            jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in self._param_template])
        args = (pavals, *batch)
        names = _argnames(self.loss_fn, len(args))
        batch_nums = (list(range(1, len(args))) if self.batch_argnums is None
                      else list(_argnums(self.batch_argnums, len(args), fname,
                                         "batch_argnums")))
        try:
            shard = microbatch_avals(args, names, batch_nums, self.batch_axis, r * m)
        except MicrobatchError as e:
            raise MicrobatchError(f"{e} (replicas={r} x microbatches={m})") from None
        trace, out, _ = trace_call(self.loss_fn, tuple(shard), {}, (0,), fname)
        loss = _check_loss(out, trace, fname)
        trace, loss, _ = prepare(trace, loss, None, self.client, self.stages, self.fuse)
        plan = build_backward(trace, loss)
        home = home_stages(trace)
        inputs = [n for n in trace.nodes if n.kind != "call"]
        n_params = len(self._param_template)
        param_nodes = inputs[:n_params]
        batch_nodes = inputs[n_params:]
        stage_ids = sorted({n.stage for n in trace.nodes if n.kind == "call"
                            and n.stage is not None})
        p = (max(stage_ids) + 1) if stage_ids else 1
        group_of_stage: dict[Any, int] = {}
        groups: list[list[int]] = []
        for i, node in enumerate(param_nodes):
            st = home.get(node.index)
            st = 0 if st is None else st
            if st not in group_of_stage:
                group_of_stage[st] = len(groups)
                groups.append([])
            groups[group_of_stage[st]].append(i)
        model = _Model(trace, plan, loss, home, [n.index for n in param_nodes],
                       [n.index for n in batch_nodes], tuple(tuple(g) for g in groups),
                       [st for st, _ in sorted(group_of_stage.items(), key=lambda kv: kv[1])],
                       p, batch_nums)
        self._cache[key] = model
        return model

    @property
    def _param_template(self) -> list[Any]:
        return self._template

    def _place(self, state: TrainState, model: "_Model") -> TrainState:
        """Put each group's parameters + optimizer state on its stage's worker(s)."""
        if state.groups is not None and state.groups != model.groups:
            raise ValueError("this state's parameter groups do not match the model's stages "
                             f"({state.groups} vs {model.groups}); was it saved from another "
                             "model or stage layout?")
        base = dataclasses.replace(state, groups=model.groups)
        placed: dict[tuple[int, int], Any] = {}
        targets = self._targets(model)
        for g, leaves in enumerate(model.groups):
            value = (*[base.params[i] for i in leaves], self._opt_from_leaves(base, g))
            for r in range(self.replicas):
                if self.client is None:
                    placed[(r, g)] = value
                    continue
                stage = model.group_stage[g] + r * model.p
                addr = targets.addresses.get(targets.target(stage)) \
                    if targets.kind == "slots" else targets.target(stage)
                placed[(r, g)] = self.client.scatter(   # a list: one Future for the tuple
                    [value], workers=[addr] if isinstance(addr, str) else None, hash=False)[0]
        return TrainState(state.step, groups=model.groups, placed=placed, owner=self._ref)

    def _targets(self, model: "_Model") -> Any:
        stages = set(range(model.p * self.replicas))
        return resolve_targets(stages, self.client, self.placement)

    # --- one step -----------------------------------------------------------------------
    def step(self, state: TrainState, *batch: Any) -> tuple[TrainState, Any]:
        """Submit one training step; returns (new state, loss) without waiting (loss is a
        Future on a cluster; a concrete scalar on the local scheduler)."""
        if self._treedef is None:
            raise RuntimeError("call Trainer.init(params) before Trainer.step")
        if not isinstance(state, TrainState):
            raise ArgumentError(
                f"Trainer.step takes the TrainState from Trainer.init (or the previous step), "
                f"got {type(state).__name__}: state = trainer.init(params); "
                "state, loss = trainer.step(state, x, t)")
        if self.client is not None:
            from .cluster import check_open

            check_open(self.client)
        model = self._model(batch)
        if not state.is_placed:
            state = self._place(state, model)
        r_count, m = self.replicas, self.microbatches
        targets = self._targets(model)
        direct = (self.schedule is not None
                  and resolve_dispatch(self.dispatch, self.client, targets) == "direct")
        # a key names one computation: this trainer's step from these very state values
        # (their Futures' keys) on this batch's content, so a step from another state or
        # on another batch never shares keys with this one, and the same step again does
        token = trace_token(model.trace, ("step", state.step, self._uid,
                                          _state_identity(state), _batch_token(batch),
                                          program_homes("direct" if direct else "", targets)))
        dsk: dict[str, Any] = {}
        stage_of: dict[str, int | None] = {}
        priority: dict[str, int] = {}
        state_refs: dict[tuple[int, int], Any] = {}
        for (r, g), value in state.placed.items():  # type: ignore[union-attr]
            if self.client is None:
                k = make_key("state", f"g{g}", g, token, model.group_stage[g] + r * model.p, None)
                dsk[k] = DataNode(k, value)
                stage_of[k] = model.group_stage[g] + r * model.p
                state_refs[(r, g)] = k
            else:
                state_refs[(r, g)] = value
        replica_loss, replica_grads = [], []
        for r in range(r_count):
            shifted = _shift(model, r * model.p)
            resident = {}
            for g, leaves in enumerate(model.groups):
                for pos, leaf in enumerate(leaves):
                    resident[model.param_nodes[leaf]] = (state_refs[(r, g)], pos)
            full = {}
            for node_idx, x in zip(model.batch_nodes, self._batch_leaves(model, batch)):
                full[node_idx] = _shard(x, self.batch_axis, r, r_count)
            home = {k: (v + r * model.p if v is not None else None)
                    for k, v in model.home.items()}
            rtoken = f"{token[:12]}{r:04x}"
            pg = lower_pipeline(shifted, model.plan, rtoken, m, self.schedule, full,
                                self.batch_axis, resident, home, model.loss, None,
                                None, stage_offset=r * model.p)
            dsk.update(pg.dsk)
            stage_of.update(pg.stage_of)
            priority.update(pg.priority)
            replica_loss.append(pg.loss_key)
            replica_grads.append(pg.grad_keys)
        # all-reduce: pairwise tree of sums over replicas, on the workers, then / r
        mean_grad: dict[int, str] = {}
        for node_idx in model.param_nodes:
            keys = [replica_grads[r].get(node_idx) for r in range(r_count)]
            if any(k is None for k in keys):
                raise RuntimeError(f"no gradient for parameter node {node_idx}")
            stage = model.home.get(node_idx)
            level = 0
            while len(keys) > 1:
                nxt = []
                for j in range(0, len(keys), 2):
                    pair = keys[j:j + 2]
                    if len(pair) == 1:
                        nxt.append(pair[0])
                        continue
                    k = make_key("reduce", f"p{node_idx}", node_idx, token, None, level * 1000 + j)
                    dsk[k] = Task(k, sum_task, (-1, -1), None, None, *map(TaskRef, pair))
                    stage_of[k] = None if stage is None else stage + j * model.p
                    nxt.append(k)
                keys, level = nxt, level + 1
            mean_grad[node_idx] = keys[0]
        new_placed: dict[tuple[int, int], str] = {}
        for r in range(r_count):
            for g, leaves in enumerate(model.groups):
                stage = model.group_stage[g] + r * model.p
                k = make_key("update", f"g{g}", g, token, stage, r)
                grads = [TaskRef(mean_grad[model.param_nodes[i]]) for i in leaves]
                scale = _Scaled(self.optimizer, r_count, f"{self._uid}-r{r_count}")
                state_ref = state_refs[(r, g)]
                ref = TaskRef(state_ref) if isinstance(state_ref, str) else state_ref
                dsk[k] = Task(k, _update_task, scale, len(leaves), ref, *grads)
                stage_of[k] = stage
                new_placed[(r, g)] = k
        lk = make_key("loss", "step", state.step, token)
        dsk[lk] = Task(lk, mean_task, *map(TaskRef, replica_loss))
        stage_of[lk] = None
        # direct dispatch: the new parameters come straight from their stage's program
        # (the next step's program on that worker reads them without a cross-worker
        # Dask edge); the loss waits for the whole step
        keep = {lk} if direct else None
        graph = build_graph(dsk, stage_of, targets, token, priority, keep, self.client,
                            outputs=set(new_placed.values()))
        outs = to_delayed(graph, token, [OutKey(lk)] + [OutKey(k) for k in new_placed.values()])
        if self.client is None:
            import dask

            values = dask.compute(*outs, scheduler="threads")
        else:
            values = self.client.compute(outs)
        loss = values[0]
        placed = dict(zip(new_placed, values[1:]))
        self._last = TrainState(state.step + 1, groups=model.groups, placed=placed, owner=self._ref)
        return self._last, loss

    def _batch_leaves(self, model: "_Model", batch: Sequence[Any]) -> list[Any]:
        args = (None, *batch)
        out = []
        for i in model.batch_argnums:
            out.extend(x for x in jax.tree_util.tree_leaves(args[i]) if hasattr(x, "shape"))
        return out

    def fit(self, batches: Iterable[Sequence[Any]], steps: int | None = None,
            progress: bool = True, state: TrainState | None = None,
            params: Any = None) -> tuple[TrainState, list[float]]:
        """Run `steps` steps (default: all batches) from `state` (default: the latest state
        of this trainer, from `init` or `step`; or `init(params)` when given), submitting
        ahead and showing a tqdm bar with the loss. Returns (state, losses)."""
        if params is not None and state is None:
            state = self.init(params)
        if state is None:
            state = self._last
        if state is None:
            raise ValueError("fit needs a state: call trainer.init(params) first, or pass "
                             "state= or params=")
        from tqdm.auto import tqdm

        total = steps
        if total is None and hasattr(batches, "__len__"):
            total = len(batches)  # type: ignore[arg-type]
        bar = tqdm(total=total, disable=not progress, desc="train", unit="step")
        pending: list[tuple[Any, TrainState]] = []    # (loss, the state it leads to)
        losses: list[float] = []
        finished = state                              # the last state whose step ended

        def take_one() -> None:
            nonlocal finished
            loss, after = pending.pop(0)
            losses.append(float(_result(loss)))
            finished = after
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            bar.update(1)

        try:
            for i, batch in enumerate(batches):
                if steps is not None and i >= steps:
                    break
                if not isinstance(batch, (tuple, list)):
                    raise ArgumentError(
                        f"Trainer.fit takes an iterable of batches, each a tuple of the loss "
                        f"function's batch arguments (e.g. [(x0, t0), (x1, t1), ...]); batch "
                        f"{i} is a {type(batch).__name__}")
                state, loss = self.step(state, *batch)
                pending.append((loss, state))
                while len(pending) > 2:  # keep two steps in flight
                    take_one()
            while pending:
                take_one()
        except KeyboardInterrupt:
            # Ctrl-C: keep the steps that already ended, let go of the others (released
            # futures stop their programs on the workers; this frame, kept alive by the
            # traceback, must not hold them), and make the last finished state this
            # trainer's latest
            while pending and getattr(pending[0][0], "status", "finished") == "finished":
                take_one()
            pending.clear()
            state = loss = None               # noqa: F841 - drop the in-flight futures
            self._last = finished
            bar.close()
            import warnings

            warnings.warn(f"Trainer.fit interrupted after {len(losses)} finished step(s); "
                          f"trainer.fit(...) goes on from step {finished.step} (the state "
                          "of the last finished step)", stacklevel=2)
            raise
        bar.close()
        if steps is not None and len(losses) < steps:
            import warnings

            warnings.warn(f"Trainer.fit: the batches ran out after {len(losses)} of "
                          f"steps={steps} steps; pass more batches (e.g. "
                          "itertools.cycle(batches)) to train longer", stacklevel=2)
        return state, losses


def _state_identity(state: TrainState) -> Any:
    """The Dask keys of a placed state's values (or the values, on the local scheduler)."""
    out = []
    for rg, v in sorted((state.placed or {}).items()):
        key = getattr(v, "key", None)
        out.append((rg, key if key is not None else _batch_token([v])))
    return tuple(out)


def _batch_token(batch: Any) -> str:
    """A content token of a step's batch (cached per jax array by dagdiff's tokenizer)."""
    from dask.base import tokenize

    return tokenize(*jax.tree_util.tree_leaves(batch), ensure_deterministic=False)


def _result(x: Any) -> Any:
    return x.result() if hasattr(x, "result") else x


class _Scaled:
    """An optax transform applied to the replica-summed gradients divided by r; `key`
    names it stably across tasks (the trainer and r) for the workers' jit cache."""

    def __init__(self, optimizer: Any, r: int, key: str = "") -> None:
        self.optimizer, self.r, self.key = optimizer, r, key

    def update(self, grads: Any, state: Any, params: Any) -> Any:
        if self.r > 1:
            grads = [g / self.r for g in grads]
        return self.optimizer.update(grads, state, params)

    def step(self, params: Any, state: Any, grads: Any) -> tuple[Any, Any]:
        import optax

        updates, new_state = self.update(grads, state, params)
        return optax.apply_updates(params, updates), new_state

    def compiled(self) -> Any:
        """The jitted `step`, compiled once per worker process and key."""
        if not self.key:
            return jax.jit(self.step)
        fn = _COMPILED_UPDATES.get(self.key)
        if fn is None:
            with _UPDATES_LOCK:
                fn = _COMPILED_UPDATES.setdefault(self.key, jax.jit(self.step))
        return fn


def _shard(x: Any, axis: int, r: int, n: int) -> Any:
    if n == 1:
        return x
    size = x.shape[axis] // n
    index = [slice(None)] * x.ndim
    index[axis] = slice(r * size, (r + 1) * size)
    return x[tuple(index)]


@dataclass
class _Model:
    trace: Any
    plan: Any
    loss: Any
    home: dict[int, int | None]
    param_nodes: list[int]
    batch_nodes: list[int]
    groups: tuple[tuple[int, ...], ...]
    group_stage: list[int]
    p: int
    batch_argnums: list[int]


def _shift(model: _Model, offset: int) -> Any:
    """The model's trace with every stage moved up by `offset` (replica placement)."""
    if offset == 0:
        return model.trace
    from .tracer import Trace

    new = Trace(model.trace.name)
    new.nodes = [dataclasses.replace(n, stage=n.stage + offset)
                 if n.kind == "call" and n.stage is not None else n for n in model.trace.nodes]
    new.closed = True
    return new


# --- checkpoints --------------------------------------------------------------------------

def save(path: str, state: TrainState, trainer: Trainer | None = None) -> None:
    """Write params, optimizer state and step with orbax-checkpoint (a directory)."""
    import os

    import orbax.checkpoint as ocp

    trainer = trainer if trainer is not None else state.trainer
    if state.is_placed:
        if trainer is None:
            raise ValueError("dd.save of a placed state needs trainer= to gather it")
        params, opts = trainer._gather(state)
        opt_leaves = [jax.tree_util.tree_leaves(o) for o in opts]
    else:
        params, opt_leaves = list(state.params or ()), [list(x) for x in state.opt_leaves or ()]
    tree = {"params": [np.asarray(x) for x in params],
            "opt": [[np.asarray(x) for x in g] for g in opt_leaves],
            "groups": [list(g) for g in state.groups or ()],
            "step": int(state.step)}
    ocp.PyTreeCheckpointer().save(os.path.abspath(path), tree, force=True)


def load(path: str) -> TrainState:
    """Read a checkpoint written by `save`; the state is placed on the next step."""
    import os

    import orbax.checkpoint as ocp

    where = os.path.abspath(path)
    if not os.path.isdir(where):
        raise CheckpointError(f"dd.load: no checkpoint directory at {where!r} (dd.save writes "
                              "one); check the path")
    try:
        tree = ocp.PyTreeCheckpointer().restore(where)
        groups = tuple(tuple(int(i) for i in g) for g in tree.get("groups") or ()) or None
        return TrainState(int(tree["step"]), params=tuple(tree["params"]),
                          opt_leaves=tuple(tuple(g) for g in tree.get("opt") or ()) or None,
                          groups=groups)
    except Exception as e:              # noqa: BLE001 - orbax raises many kinds
        raise CheckpointError(
            f"dd.load: {where!r} is not a readable dd.save checkpoint ({type(e).__name__}: "
            f"{str(e)[:200]}); it may be incomplete or corrupt (a save interrupted, files "
            "changed): load an earlier checkpoint, or save again") from e
