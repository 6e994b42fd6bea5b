"""Optional dependencies: import one for a feature, or fail naming the extra to install."""
from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError


__all__ = ["EXTRAS", "require", "available"]

#: the pip extra that installs each optional module (``pip install "dagdiff[viz]"``)
EXTRAS = {
    "graphviz": "viz",
    "bokeh": "viz",
    "matplotlib": "viz",
    "sklearn": "demo",
    "orbax.checkpoint": "checkpoint",
    "tqdm": "progress",
    "tqdm.auto": "progress",
    "torch": "bench",
    "cryptography": "tls",
    "flax": "flax",
    "flax.nnx": "flax",
    "flax.linen": "flax",
    "equinox": "equinox",
}


def available(module: str) -> bool:
    """True when `module` can be imported here."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def require(module: str, feature: str) -> ModuleType:
    """Import `module`, or raise `MissingDependencyError` naming the extra that has it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        extra = EXTRAS.get(module, "all")
        raise MissingDependencyError(
            f"{feature} needs the optional package {module.split('.')[0]!r}, which is not "
            f"installed ({e}); install it with: pip install \"dagdiff[{extra}]\"") from e
