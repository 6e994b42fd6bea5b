"""What runs on the workers: task functions, jit caches and counters, serializers for JAX
arrays, the scheduler/worker plugins and direct dispatch."""
from __future__ import annotations


__all__: list[str] = []
