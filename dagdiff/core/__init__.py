"""The model as data, before any Dask graph: layers (and the model libraries' modules),
custom layers, stages, the tracer, the backward plan, fusion and stage balancing.
Nothing here imports `distributed`; of Dask, only `dask.base.tokenize` (fingerprints)."""
from __future__ import annotations

from . import modules  # noqa: F401  (dd.layer of Flax/Equinox modules; registers with layer)
from . import ops  # noqa: F401  (operators on traced values; fills tracer.OPERATORS)


__all__: list[str] = []
