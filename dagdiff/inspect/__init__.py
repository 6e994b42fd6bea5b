"""Seeing it work: the traced graph (table and picture), dd.record timelines, counters."""
from __future__ import annotations


__all__: list[str] = []
