"""`dd.value_and_grad`, `dd.grad` and `dd.trace`: trace a loss function and return Dask
collections (or the graph to look at), all through `dagdiff.build.build`."""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Mapping, Sequence

import dask

from .build import Options, build
from .cluster.info import current_client, forget_workers, lost_workers, may_be_a_lost_worker
from .inspect.graph import TracedGraph
from .errors import DirectDispatchError


__all__ = ["value_and_grad", "grad", "trace"]

log = logging.getLogger(__name__)


def value_and_grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0,
                   has_aux: bool = False, *, microbatches: int = 1, schedule: Any = None,
                   batch_argnums: Sequence[int] | None = None, batch_axis: int = 0,
                   stages: int | str | Any = None,
                   placement: Mapping[int, Any] | None = None, fuse: bool | None = None,
                   resident: bool = True, dispatch: str | None = None,
                   remat: str | Mapping[int, str] | None = None) -> Callable[..., Any]:
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
    that many stages (auto: one per worker/device) balanced by XLA's cost estimate;
    ``stages=profile`` (a `dd.Profile`) balances them by measured times instead.
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
    or Dask task per action (see `dagdiff.runtime.direct`). "scheduler" keeps every edge
    a Dask dependency (ordering edges between a worker's actions): slower per action,
    but Dask recomputes lost work.

    ``remat`` chooses what a stage's forward keeps for its backward: "none" (default:
    every residual), "full" (only the stage's input; its forward runs again in the
    backward), "selective" (matrix products kept, the rest recomputed), or ``{stage:
    policy}`` (stages left out: "none"). Custom layers (`dd.custom_layer`: NumPy/CuPy
    rules) keep their residuals under every policy: their forward does not run again.
    `dd.best_schedule(..., memory_limit=)` chooses one per stage (`Prediction.remat`). See
    `dagdiff.core.remat`.

    ``step.compute(*args, retries=2)`` builds and computes at once, building and running
    the step again when a worker was lost mid-step (see `compute` on the returned
    function).
    """
    options = Options.make("dd.value_and_grad", argnums=argnums, has_aux=has_aux,
                           microbatches=microbatches, schedule=schedule,
                           batch_argnums=batch_argnums, batch_axis=batch_axis, stages=stages,
                           placement=placement, fuse=fuse, resident=resident,
                           dispatch=dispatch, remat=remat)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return build(fn, args, kwargs, options, current_client()).outputs()

    def compute(*args: Any, retries: int = 2, client: Any = None, **kwargs: Any) -> Any:
        """Build the step and compute it now: ``loss, grads`` (``(loss, aux), grads``) as
        values. A step that fails because a worker was lost (or restarted) is built again
        for the live workers (a lost worker's stages run on the others until its
        replacement joins) and run again at once, up to `retries` times; any other error
        is raised at once."""
        client = client if client is not None else current_client()
        for attempt in range(retries + 1):
            built = build(fn, args, kwargs, options, client)
            if client is None:
                return dask.compute(*built.outputs())
            try:
                return built.values(client)
            except Exception as error:                 # noqa: BLE001 - classified below
                gone = lost_workers(client, built.targets.worker_addresses(),
                                    wait=10.0 if may_be_a_lost_worker(error) else 0.0)
                if not gone:
                    raise
                if attempt == retries:
                    # Dask says only that a value was "cancelled ... already forgotten"
                    # (the lost worker's resident parameters went with it): say what
                    raise DirectDispatchError(
                        f"{getattr(fn, '__name__', 'the step')}: worker(s) "
                        f"{', '.join(gone)} were lost while the step ran "
                        f"({type(error).__name__}: {error})"
                        + (f", after {retries} retries" if retries else "")
                        + "; compute it again (step.compute(..., retries=n) builds it for the "
                        "live workers), or find why workers are lost (memory, a crash: the "
                        "workers' logs)") from error
                log.warning("dagdiff: %s lost worker(s) %s (%s); building and running it "
                            "again", getattr(fn, "__name__", "the step"), ", ".join(gone),
                            type(error).__name__)
                del built                               # let go of the failed step
                # built again for the workers there now: a lost worker's stages run on
                # the live ones (no waiting for its replacement), unless none is left
                forget_workers(client)
                client.wait_for_workers(1, timeout=300)
        raise AssertionError("unreachable")             # the loop returns or raises

    wrapped.compute = compute  # type: ignore[attr-defined]
    return wrapped


def grad(fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False,
         **options: Any) -> Callable[..., Any]:
    """Like `jax.grad`: the gradient pytree (Delayed leaves), or (grads, aux); takes the
    options of `value_and_grad` (microbatches, schedule, stages, placement, ...)."""
    vg = value_and_grad(fn, argnums=argnums, has_aux=has_aux, **options)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out, grads = vg(*args, **kwargs)
        return (grads, out[1]) if has_aux else grads

    def compute(*args: Any, retries: int = 2, client: Any = None, **kwargs: Any) -> Any:
        """As `value_and_grad`'s ``compute``: the gradients (``(grads, aux)``) as values."""
        out, grads = vg.compute(*args, retries=retries, client=client,  # type: ignore
                                **kwargs)
        return (grads, out[1]) if has_aux else grads

    wrapped.compute = compute  # type: ignore[attr-defined]
    return wrapped


def trace(fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False,
          **options: Any) -> Callable[..., TracedGraph]:
    """Like `dd.value_and_grad(fn, ...)` (same options: microbatches, schedule, stages,
    placement, fuse, ...) but returns a `TracedGraph` to inspect; runs nothing. On a
    cluster it shows the forward and VJP tasks (the graph of ``dispatch="scheduler"``,
    unless `dispatch` is given): direct dispatch runs the same tasks, in the same order,
    as the actions of one program task per worker, which would hide them."""
    options.setdefault("dispatch", "scheduler")
    opts = Options.make("dd.trace", argnums=argnums, has_aux=has_aux, **options)

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> TracedGraph:
        return TracedGraph(build(fn, args, kwargs, opts, current_client()))

    return wrapped
