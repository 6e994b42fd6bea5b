"""Pytree classes that travel by value (defined in a script, a notebook or a function): how
JAX flattens them, captured where a layer is traced and registered again on the workers,
where cloudpickle rebuilds the class but not its JAX registration."""
from __future__ import annotations

import dataclasses
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import jax


__all__ = ["PytreeClass", "pytree_classes", "register_all", "travels_by_value"]

_lock = threading.Lock()
#: classes this process registered (or found registered): each once
_done: "weakref.WeakSet[type]" = weakref.WeakSet()


@dataclass(frozen=True)
class PytreeClass:
    """A pytree node class that is pickled by value, and its registration: ``"methods"``
    (`jax.tree_util.register_pytree_node_class`: `tree_flatten` / `tree_unflatten`),
    ``"dataclass"`` (`register_dataclass`, `flax.struct.dataclass`: `data_fields` are its
    children, `meta_fields` its static part), or ``"unknown"`` (registered with functions
    of the user's own: a worker cannot know them)."""

    cls: type
    kind: str
    data_fields: tuple[str, ...] = ()
    meta_fields: tuple[str, ...] = ()

    def register(self) -> None:
        """Register the class with JAX in this process (once; a class already registered,
        as in the process that traced it, is left as it is)."""
        if self.kind == "unknown" or self.cls in _done:
            return
        with _lock:
            if self.cls in _done:
                return
            try:
                if self.kind == "methods":
                    jax.tree_util.register_pytree_node_class(self.cls)
                else:
                    jax.tree_util.register_dataclass(self.cls, list(self.data_fields),
                                                     list(self.meta_fields))
            except ValueError as e:                  # registered already in this process
                if "egistration" not in str(e) and "egistered" not in str(e):
                    raise
            _done.add(self.cls)

    @property
    def hint(self) -> str:
        """What to do when a worker cannot rebuild this class's pytrees."""
        return (f"pytree class {self.cls.__qualname__} is defined in {self.cls.__module__} "
                "and registered with flatten functions of its own, which a worker cannot "
                "get: define it in a module the workers import, or register it with "
                "jax.tree_util.register_dataclass / register_pytree_node_class")


def travels_by_value(cls: type) -> bool:
    """Whether cloudpickle sends `cls` by value (its module is ``__main__``, it is defined
    inside a function, or its module is not importable), so a worker does not import the
    module that registers it."""
    module = getattr(cls, "__module__", None)
    return (module == "__main__" or module not in sys.modules
            or "<locals>" in getattr(cls, "__qualname__", ""))


_BUILTIN = (tuple, list, dict, type(None))


def pytree_classes(treedef: Any) -> tuple[PytreeClass, ...]:
    """The node classes of `treedef` that travel by value, each once, with their
    registration."""
    found: dict[type, PytreeClass] = {}
    stack = [treedef]
    while stack:
        td = stack.pop()
        nd = td.node_data()
        if nd is None:
            continue
        cls, aux = nd
        children = td.children()
        stack.extend(children)
        if (not isinstance(cls, type) or cls in found or issubclass(cls, _BUILTIN)
                or not travels_by_value(cls)):
            continue
        found[cls] = _registration(cls, aux, len(children))
    return tuple(found.values())


def _registration(cls: type, aux: Any, n_children: int) -> PytreeClass:
    if callable(getattr(cls, "tree_flatten", None)) and \
            callable(getattr(cls, "tree_unflatten", None)):
        return PytreeClass(cls, "methods")
    if dataclasses.is_dataclass(cls):
        fields = [f for f in dataclasses.fields(cls) if f.init]
        meta = tuple(f.name for f in fields if f.metadata.get("static", False)
                     or f.metadata.get("pytree_node", True) is False)
        data = tuple(f.name for f in fields if f.name not in meta)
        if len(data) == n_children and (not isinstance(aux, tuple) or len(aux) == len(meta)):
            return PytreeClass(cls, "dataclass", data, meta)
    return PytreeClass(cls, "unknown")


def register_all(classes: tuple[PytreeClass, ...]) -> None:
    """Register every class of `classes` in this process (`PytreeClass.register`)."""
    for c in classes:
        c.register()
