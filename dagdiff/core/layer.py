"""`dd.layer`: mark a JAX-differentiable function as one node (forward + VJP task) of the graph."""
from __future__ import annotations

import functools
from typing import Any, Callable, overload

import jax
from dask.base import tokenize

from ..errors import ArgumentError
from .byvalue import payload, portable, reads, revive
from .keys import sanitize
from .stage import check_stage
from .tracer import call_layer


__all__ = ["Layer", "layer", "register_maker"]


class Layer:
    """A JAX function recorded as one forward task and one VJP task per call while tracing.

    Called on concrete arrays (outside tracing, or under `jax.grad`/`jax.jit`) it simply
    runs `fn`, so the same model code runs eagerly too.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str | None = None,
        remat: bool = False,
        stage: int | None = None,
    ) -> None:
        if not callable(fn):
            hint = (f"; to name a layer write dd.layer(name={fn!r}) as a decorator"
                    if isinstance(fn, str) else "")
            raise ArgumentError(f"dd.layer needs a callable, got {type(fn).__name__}{hint}")
        self.fn = fn
        self.name = sanitize(name or getattr(fn, "__name__", None) or "layer")
        self.remat = bool(remat)
        self.stage = check_stage(stage, f"stage of layer {self.name!r}")
        functools.update_wrapper(self, fn, updated=())
        self._fingerprint: str | None = None

    def functions(self) -> tuple[Any, ...]:
        """The functions this layer runs (what `byvalue.reads` looks into); a fused run's
        (`fuse.Segment`) are its layers'."""
        inner = getattr(self.fn, "functions", None)
        return inner() if callable(inner) else (self.fn,)

    def _base_fingerprint(self) -> str:
        return tokenize(self.fn, self.name, self.remat, ensure_deterministic=False)

    @property
    def fingerprint(self) -> str:
        """A stable hash of the function (code, closure, defaults) and of the plain values
        it reads from its module (`byvalue.reads`: a global changed in a later notebook
        cell makes another fingerprint), for worker-side jit caches."""
        if self._fingerprint is None:
            self._fingerprint = self._base_fingerprint()
        extra = portable(reads(self.functions()))
        return f"{self._fingerprint}-{extra}" if extra else self._fingerprint

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return call_layer(self, args, kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        # by value, as bytes made once per layer (`byvalue`): every step's graph holds its
        # layers, and cloudpickling a function (and distributed's plain-pickle attempt
        # before it) cost ~1 ms a layer per pickling; a process that already revived these
        # bytes gives back the same Layer object, so none is rebuilt per task
        return (_revive, payload(self, _ident(self),
                                 lambda: (type(self), self.__getstate__())))

    def __copy__(self) -> "Layer":
        new = type(self).__new__(type(self))
        new.__dict__.update((k, v) for k, v in self.__dict__.items() if k != "_payload")
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> "Layer":
        return self.__copy__()          # functions are shared by copies, as copy.deepcopy does

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("__wrapped__", "_payload")}
        state["fn"] = _portable(self.fn)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["fn"] = _restore(state["fn"])
        self.__dict__.update(state)
        self.__dict__["__wrapped__"] = state["fn"]

    def __repr__(self) -> str:
        extra = "".join([", remat=True" if self.remat else "",
                         f", stage={self.stage}" if self.stage is not None else ""])
        return f"dd.layer({self.name}{extra})"


@overload
def layer(fn: Callable[..., Any], *, name: str | None = ..., remat: bool = ...,
          stage: int | None = ...) -> Layer: ...


@overload
def layer(fn: None = ..., *, name: str | None = ..., remat: bool = ...,
          stage: int | None = ...) -> Callable[[Callable[..., Any]], Layer]: ...


def layer(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    remat: bool = False,
    stage: int | None = None,
) -> Layer | Callable[[Callable[..., Any]], Layer]:
    """Wrap `fn` as a dagdiff layer: ``@dd.layer``, ``@dd.layer(name=..., remat=True)``,
    or ``dd.layer(fn, name="enc", stage=1)``.

    `remat=True` keeps only the primal inputs after the forward task and recomputes the
    forward inside the VJP task (less memory, more compute).

    A Flax NNX or Equinox module instance gives a layer called like the module
    (``dd.layer(block)(x)``) whose arrays are its parameters; `nnx.Sequential` and
    `eqx.nn.Sequential` record one layer call per element. A Flax Linen module gives a
    layer called ``layer(variables, x)`` (``module.apply``). See `dagdiff.core.modules`.
    """
    if fn is None:
        return lambda f: layer(f, name=name, remat=remat, stage=stage)
    for make in _MAKERS:                   # a model library's module (dagdiff.core.modules)
        made = make(fn, name, remat, stage)
        if made is not None:
            return made
    return Layer(fn, name=name, remat=remat, stage=stage)


#: functions (obj, name, remat, stage) -> Layer | None that `layer` asks first: how
#: `dagdiff.core.modules` makes layers of Flax and Equinox modules (it builds on Layer)
_MAKERS: list[Callable[[Any, str | None, bool, int | None], "Layer | None"]] = []


def register_maker(make: Callable[[Any, str | None, bool, int | None], "Layer | None"]
                   ) -> None:
    """Let `make` turn objects of another kind (a module instance) into layers."""
    if make not in _MAKERS:
        _MAKERS.append(make)


def _ident(layer: Layer) -> tuple[Any, ...]:
    """What a layer's pickled bytes depend on: its function, and what the function reads
    that cloudpickle takes with it (a notebook's globals; `byvalue.reads`)."""
    return (id(layer.fn), layer.name, layer.remat, layer.stage, reads(layer.functions()))


def _make(state: tuple[type, dict[str, Any]]) -> Layer:
    cls, st = state
    obj = cls.__new__(cls)
    obj.__setstate__(st)
    return obj


def _revive(digest: str, data: bytes) -> Layer:
    """The Layer pickled as `data` (its digest `digest`): the one this process already
    made from these bytes (or sent as them), else a new one."""
    return revive(digest, data, _make, _ident)


def _portable(fn: Any) -> Any:
    """`jax.custom_vjp`/`custom_jvp` objects do not unpickle; send their parts instead."""
    if isinstance(fn, jax.custom_vjp):
        return ("custom_vjp", fn.fun, fn.nondiff_argnums, fn.fwd, fn.bwd)
    if isinstance(fn, jax.custom_jvp):
        return ("custom_jvp", fn.fun, fn.nondiff_argnums, fn.jvp)
    return fn


def _restore(obj: Any) -> Any:
    if isinstance(obj, tuple) and obj and obj[0] == "custom_vjp":
        _, fun, nondiff, fwd, bwd = obj
        new = jax.custom_vjp(fun, nondiff_argnums=nondiff)
        new.defvjp(fwd, bwd)
        return new
    if isinstance(obj, tuple) and obj and obj[0] == "custom_jvp":
        _, fun, nondiff, jvp = obj
        new = jax.custom_jvp(fun, nondiff_argnums=nondiff)
        new.defjvp(jvp)
        return new
    return obj
