"""Example models built with dagdiff (used by the demo, tests and notebooks): the digits demo,
the multimodal model, sleep stand-in stages."""
from __future__ import annotations


__all__: list[str] = []
