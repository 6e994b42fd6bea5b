"""dagdiff: autodiff on a Dask task graph - each layer call is a forward task plus a VJP task.

The package, from the bottom up (each layer imports only those below it; CI checks it
with import-linter, see setup.cfg):

- `errors`: every error type.
- `core`: the model as data - layers (Flax and Equinox modules too), custom layers,
  stages, the tracer, the backward plan, fusion, stage balancing, batch buckets (no
  distributed; of Dask only `dask.base.tokenize`, for stable fingerprints);
  `schedules`: pipeline schedules as pure data and their simulator (no JAX, no Dask).
- `runtime`: what runs on the workers - task functions, jit caches, serializers, the
  scheduler/worker plugins and direct dispatch; `runtime.internals` is the one module
  that touches distributed's private parts.
- `cluster`: where stages run (targets, resident parameters) and `dd.local_cluster`.
- `lowering`: traced model -> Dask tasks (keys, microbatches, schedule order, graph).
- `build`: the one build path (trace, prepare, place, lower, assemble); its pipelined
  core (`build.step`: replicas, assembly, step templates) is what `dd.Trainer` extends.
- `inspect`: the graph picture, `dd.record` timelines, counters (read-only).
- `plan`: `dd.profile` measurements, the `Profile` cost model, `dd.predict` and
  `dd.best_schedule`.
- `api` (`dd.value_and_grad`, `dd.grad`, `dd.trace`) and `train` (`dd.Trainer`,
  checkpoints): what users call. `kernels`: hand-written kernels with VJP rules;
  `examples`: the demo, the multimodal model, sleep stand-in stages.
"""
from __future__ import annotations

from . import kernels
from .api import grad, trace, value_and_grad
from .cluster.local import local_cluster
from .core.buckets import pad_to_bucket
from .core.custom import CustomLayer, custom_layer
from .core.keys import KeyInfo, key_info
from .core.layer import Layer, layer
from .core.stage import stage
from .core.tracer import Traced
from .errors import (
    ArgumentError,
    CheckpointError,
    ClientClosedError,
    CustomRuleError,
    CycleError,
    DagdiffError,
    DirectDispatchError,
    KeyFormatError,
    LostStateError,
    MemoryLimitError,
    LayerShapeError,
    LayerTypeError,
    MicrobatchError,
    MissingDependencyError,
    OptimizerError,
    PlacementError,
    ScheduleError,
    TracerError,
    TrainerError,
    UpstreamError,
    WorkerLostError,
)
from .inspect.graph import TracedGraph
from .inspect.metrics import (compile_counts, peak_live, remat_count, reset_peak_live,
                              reset_remat_count)
from .plan.costs import Profile
from .plan.predict import Prediction, best_schedule, predict
from .plan.profile import profile
from .inspect.capture import record
from .runtime.direct import install
from .runtime.serialize import register as _register_serializers
from .runtime.worker_jax import configure_worker_jax
from .schedules import PipelineProgram, Schedule, compile_schedule, get_schedule
from .train.checkpoint import load, save
from .train.trainer import Trainer, TrainState


_register_serializers()

__version__ = "0.1.0"


def dask_setup(worker: object) -> None:
    """Preload hook (``dask worker --preload dagdiff``, and dd.local_cluster's workers):
    make its JAX settings (`runtime.worker_jax`: CPU computations run inline) and install
    its direct-dispatch runtime, before any task arrives."""
    configure_worker_jax(worker)
    install(worker)


__all__ = [
    "layer",
    "Layer",
    "custom_layer",
    "CustomLayer",
    "kernels",
    "value_and_grad",
    "grad",
    "stage",
    "local_cluster",
    "key_info",
    "record",
    "profile",
    "Profile",
    "predict",
    "Prediction",
    "best_schedule",
    "trace",
    "TracedGraph",
    "KeyInfo",
    "Traced",
    "Trainer",
    "TrainState",
    "save",
    "load",
    "remat_count",
    "compile_counts",
    "pad_to_bucket",
    "reset_remat_count",
    "peak_live",
    "reset_peak_live",
    "Schedule",
    "ScheduleError",
    "ArgumentError",
    "MemoryLimitError",
    "get_schedule",
    "compile_schedule",
    "PipelineProgram",
    "DagdiffError",
    "LayerShapeError",
    "LayerTypeError",
    "TracerError",
    "KeyFormatError",
    "PlacementError",
    "MicrobatchError",
    "DirectDispatchError",
    "UpstreamError",
    "CheckpointError",
    "ClientClosedError",
    "CustomRuleError",
    "CycleError",
    "TrainerError",
    "WorkerLostError",
    "LostStateError",
    "MissingDependencyError",
    "OptimizerError",
]
