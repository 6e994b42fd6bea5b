"""Example models built with dagdiff (used by the demo, tests and notebooks)."""
