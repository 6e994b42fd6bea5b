"""Where stages run: targets (slots, addresses, devices), resident parameters, worker info, and
the embedded dd.local_cluster."""
from __future__ import annotations


__all__: list[str] = []
