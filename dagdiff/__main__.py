"""Entry point: ``python -m dagdiff demo``."""
from __future__ import annotations

import sys

from .examples.demo import main


if __name__ == "__main__":
    sys.exit(main())
