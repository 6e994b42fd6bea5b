"""Lowering: a traced model and its backward plan -> Dask tasks (forward/VJP tasks,
microbatches, schedule order) -> one HighLevelGraph."""
from __future__ import annotations


__all__: list[str] = []
