"""dagdiff: autodiff on a Dask task graph - each layer call is a forward task plus a VJP task."""
from __future__ import annotations

from .api import grad, value_and_grad
from .cluster import local_cluster
from .custom import CustomLayer, custom_layer
from .errors import (
    ArgumentError,
    CheckpointError,
    ClientClosedError,
    DagdiffError,
    DirectDispatchError,
    KeyFormatError,
    LayerShapeError,
    LayerTypeError,
    MicrobatchError,
    PlacementError,
    TracerError,
)
from .graph import TracedGraph, trace
from .inspect_ import record
from .keys import KeyInfo, key_info
from .layer import Layer, layer
from .metrics import peak_live, remat_count, reset_peak_live, reset_remat_count
from .placement import stage
from .schedules import Schedule, ScheduleError, get_schedule
from .serialize import register as _register_serializers
from .tracer import Traced
from .train import Trainer, TrainState, load, save

_register_serializers()

from . import kernels  # noqa: E402  (dd.kernels.bias_gelu etc.; needs the names above)

__version__ = "0.1.0"


def dask_setup(worker: object) -> None:
    """Preload hook (``dask worker --preload dagdiff``, and dd.local_cluster's workers):
    install the worker's direct-dispatch runtime before any task arrives."""
    from .direct import install

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
    "trace",
    "TracedGraph",
    "KeyInfo",
    "Traced",
    "Trainer",
    "TrainState",
    "save",
    "load",
    "remat_count",
    "reset_remat_count",
    "peak_live",
    "reset_peak_live",
    "Schedule",
    "ScheduleError",
    "ArgumentError",
    "get_schedule",
    "DagdiffError",
    "LayerShapeError",
    "LayerTypeError",
    "TracerError",
    "KeyFormatError",
    "PlacementError",
    "MicrobatchError",
    "DirectDispatchError",
    "CheckpointError",
    "ClientClosedError",
]
