"""Tracing: run a Python function once, recording every `dd.layer` call as a frozen `Node`.

Traced values carry shape and dtype (from `jax.eval_shape`), never data, so the
graph is known before anything runs and shape errors surface at trace time.
"""
from __future__ import annotations

import threading
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import jax
import numpy as np

from ..errors import CustomRuleError, LayerShapeError, LayerTypeError, TracerError
from .spec import CallSpec, make_call_spec
from .stage import current_stage


if TYPE_CHECKING:
    from .layer import Layer

__all__ = ["Traced", "Node", "Trace", "call_layer", "is_array", "fmt_aval", "aval_of",
           "home_stages", "OPERATORS"]

#: the layers behind operators on traced values ("add", "matmul", "neg", "getitem",
#: "transpose", ...), filled in by `dagdiff.core.ops`
OPERATORS: dict[str, Callable[..., Any]] = {}

_ACTIVE: ContextVar["Trace | None"] = ContextVar("dagdiff_trace", default=None)


def is_array(x: Any) -> bool:
    """True for concrete array leaves (NumPy arrays and scalars, JAX arrays)."""
    return isinstance(x, (np.ndarray, np.generic, jax.Array))


def fmt_aval(aval: Any) -> str:
    """Short 'f32[512,1024]' text for a shape/dtype record or array."""
    try:
        dt = np.dtype(aval.dtype)
    except TypeError:                    # an extended dtype (a PRNG key array)
        return f"{aval.dtype}[{','.join(map(str, aval.shape))}]"
    code = {"f": "f", "i": "i", "u": "u", "b": "bool", "c": "c"}.get(dt.kind, dt.kind)
    name = "bool" if code == "bool" else f"{code}{dt.itemsize * 8}"
    return f"{name}[{','.join(map(str, aval.shape))}]"


def aval_of(x: Any) -> jax.ShapeDtypeStruct:
    """Shape and dtype of a concrete array leaf."""
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    return jax.ShapeDtypeStruct(np.shape(x), dtype)


def _describe(x: Any) -> str:
    if isinstance(x, Traced) or is_array(x):
        return fmt_aval(x)
    return repr(x)


@dataclass(frozen=True, eq=False, slots=True)
class Traced:
    """A value produced while tracing: a leaf of an input or of a layer call's output.

    It has `.shape`, `.dtype`, `.ndim` and `.size`, supports arithmetic operators and
    indexing (each recorded as a small layer), and refuses anything that needs data.
    """

    trace: "Trace"
    node: int
    leaf: int
    aval: jax.ShapeDtypeStruct
    requires_grad: bool

    shape = property(lambda self: self.aval.shape)
    dtype = property(lambda self: self.aval.dtype)
    ndim = property(lambda self: len(self.aval.shape))
    size = property(lambda self: int(np.prod(self.aval.shape, dtype=np.int64)))

    @property
    def T(self) -> Any:
        return OPERATORS["transpose"](self)

    def __repr__(self) -> str:
        node = self.trace.nodes[self.node]
        return f"Traced({fmt_aval(self.aval)}, from {node.kind} {node.name!r} #{self.node})"

    def _needs_data(self, what: str) -> TracerError:
        node = self.trace.nodes[self.node]
        value = f"traced value {fmt_aval(self.aval)} (output of {node.kind} {node.name!r})"
        err = TracerError(
            f"{what} needs the data of {value}, which does not exist while tracing. Put the "
            "code that uses it inside a function wrapped in dd.layer; control flow may only "
            "depend on static values (shapes, config)."
        )
        err.value = value                    # type: ignore[attr-defined]
        return err

    def __bool__(self) -> bool:
        raise self._needs_data("bool() (an if/while on a traced value)")

    def __array__(self, *a: Any, **k: Any) -> Any:
        raise self._needs_data("np.asarray()")

    def __jax_array__(self) -> Any:
        raise self._needs_data("A jax.numpy function called outside any dd.layer")

    def __iter__(self) -> Any:
        raise self._needs_data("Iterating")

    def __len__(self) -> int:
        if not self.aval.shape:
            raise TracerError("len() of a 0-d traced value")
        return int(self.aval.shape[0])

    def __float__(self) -> float:
        raise self._needs_data("float()")

    def __int__(self) -> int:
        raise self._needs_data("int()")

    def __index__(self) -> int:
        raise self._needs_data("Using a traced value as an index")

    def __hash__(self) -> int:
        return id(self)

    def __lt__(self, o: Any) -> Any:
        raise self._needs_data("A comparison (<, <=, >, >=)")

    __le__ = __gt__ = __ge__ = __lt__

    def __getattr__(self, name: str) -> Any:
        if name in _ARRAY_METHODS:
            node = self.trace.nodes[self.node]
            raise TracerError(
                f"traced value {fmt_aval(self.aval)} (output of {node.kind} {node.name!r}) has "
                f"no .{name}() outside a layer: only operators (+, -, *, /, @, **) and "
                "indexing are recorded between layers. Compute it inside a function wrapped "
                "in dd.layer (e.g. the loss layer).")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getitem__(self, index: Any) -> Any:
        return OPERATORS["getitem"](self, index)

    def __add__(self, o: Any) -> Any: return OPERATORS["add"](self, o)
    def __radd__(self, o: Any) -> Any: return OPERATORS["add"](o, self)
    def __sub__(self, o: Any) -> Any: return OPERATORS["sub"](self, o)
    def __rsub__(self, o: Any) -> Any: return OPERATORS["sub"](o, self)
    def __mul__(self, o: Any) -> Any: return OPERATORS["mul"](self, o)
    def __rmul__(self, o: Any) -> Any: return OPERATORS["mul"](o, self)
    def __truediv__(self, o: Any) -> Any: return OPERATORS["truediv"](self, o)
    def __rtruediv__(self, o: Any) -> Any: return OPERATORS["truediv"](o, self)
    def __matmul__(self, o: Any) -> Any: return OPERATORS["matmul"](self, o)
    def __rmatmul__(self, o: Any) -> Any: return OPERATORS["matmul"](o, self)
    def __pow__(self, o: Any) -> Any: return OPERATORS["pow"](self, o)
    def __neg__(self) -> Any: return OPERATORS["neg"](self)
    def __pos__(self) -> Any: return self


#: ndarray methods a user may try on a traced value between layers
_ARRAY_METHODS = frozenset(
    "sum mean max min prod std var argmax argmin any all cumsum cumprod reshape astype "
    "squeeze flatten ravel transpose swapaxes clip round dot item tolist conj real imag "
    "nonzero sort argsort trace diagonal repeat take".split())


@dataclass(frozen=True, eq=False)
class Node:
    """One recorded value source: a differentiated input ('param'), another input
    ('input'), or a layer call ('call') with its inputs, spec and output avals."""

    index: int
    kind: str
    name: str
    stage: int | None
    out_treedef: Any
    out_avals: tuple[jax.ShapeDtypeStruct, ...]
    requires_grad: bool
    value: Any = None
    spec: CallSpec | None = None
    in_leaves: tuple[Any, ...] = ()
    path: str = ""

    @property
    def layer(self) -> Layer | None:
        return self.spec.layer if self.spec is not None else None

    @property
    def traced_inputs(self) -> list[tuple[int, Traced]]:
        """(dynamic position, Traced) for each traced input leaf, in order."""
        out, pos = [], 0
        for leaf, kind in zip(self.in_leaves, self.spec.kinds if self.spec else ()):
            if kind == "d":
                if isinstance(leaf, Traced):
                    out.append((pos, leaf))
                pos += 1
        return out


class Trace:
    """The record of one traced call: the nodes in execution order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.nodes: list[Node] = []
        self.closed = False

    @property
    def stages(self) -> set[int]:
        """The stages of its layer calls (unstaged calls left out)."""
        return {n.stage for n in self.nodes if n.kind == "call" and n.stage is not None}

    @property
    def num_stages(self) -> int:
        """1 + the highest stage of its layer calls (0 when none is staged)."""
        stages = self.stages
        return max(stages) + 1 if stages else 0

    def __enter__(self) -> "Trace":
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.reset(self._token)
        self.closed = True

    def add_input(self, value: Any, path: str, differentiable: bool) -> Traced:
        """Record an input leaf; differentiated ones become 'param' nodes."""
        aval = aval_of(value)
        grad = differentiable and jax.dtypes.issubdtype(aval.dtype, np.inexact)
        node = Node(
            index=len(self.nodes), kind="param" if grad else "input", name=path, stage=None,
            out_treedef=jax.tree_util.tree_structure(0), out_avals=(aval,),
            requires_grad=grad, value=value, path=path,
        )
        self.nodes.append(node)
        return Traced(self, node.index, 0, aval, grad)

    def add_call(self, layer: Layer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Record one layer call, checking shapes with `jax.eval_shape`; returns traced outputs."""
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, Traced) and leaf.trace is not self:
                raise TracerError(
                    f"layer {layer.name!r} got a traced value from another trace "
                    f"({leaf.trace.name!r}); traced values cannot leave the function that "
                    "dd.value_and_grad traced. Return it instead, or trace once."
                )
        stage = layer.stage if layer.stage is not None else current_stage()
        if stage is None:
            # outside any `dd.stage` block (``return mse(h, t)`` after the last one, or
            # ``loss * 2``): on its traced inputs' stage when they all come from one
            stages = {self.nodes[x.node].stage for x in leaves if isinstance(x, Traced)}
            stages.discard(None)
            if len(stages) == 1:
                stage = stages.pop()
        spec, out_treedef, out_avals = _infer(layer, treedef, leaves, stage)
        grad = any(isinstance(x, Traced) and x.requires_grad for x in leaves)
        node = Node(
            index=len(self.nodes), kind="call", name=layer.name, stage=stage,
            out_treedef=out_treedef, out_avals=out_avals, requires_grad=grad,
            spec=spec, in_leaves=tuple(leaves),
        )
        self.nodes.append(node)
        outs = [Traced(self, node.index, i, a, grad and _inexact(a))
                for i, a in enumerate(out_avals)]
        return jax.tree_util.tree_unflatten(out_treedef, outs)


def call_layer(layer: Layer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Record a layer call if any argument is traced; otherwise just run the function."""
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    trace = next((x.trace for x in leaves if isinstance(x, Traced)), None)
    if trace is None:
        return layer.fn(*args, **kwargs)
    if trace.closed:
        raise TracerError(
            f"layer {layer.name!r} was called on a traced value after its trace "
            f"({trace.name!r}) ended; traced values only exist while dd.value_and_grad traces."
        )
    return trace.add_call(layer, args, kwargs)


def _inexact(aval: Any) -> bool:
    return bool(jax.dtypes.issubdtype(aval.dtype, np.inexact))


# (layer, treedef, leaf signature) -> (spec, out_treedef, out_avals); shapes checked once.
_INFER_CACHE: dict[Any, tuple[CallSpec, Any, tuple[jax.ShapeDtypeStruct, ...]]] = {}
_INFER_LOCK = threading.Lock()


def _infer(layer: Layer, treedef: Any, leaves: Sequence[Any], stage: int | None) -> tuple[
    CallSpec, Any, tuple[jax.ShapeDtypeStruct, ...]
]:
    sig = []
    for x in leaves:
        if isinstance(x, Traced):
            sig.append(("t", x.aval.shape, x.aval.dtype, x.requires_grad))
        elif is_array(x):
            a = aval_of(x)
            sig.append(("c", a.shape, a.dtype, False))
        else:
            sig.append(("s", type(x), x))
    # the fingerprint: a global the layer reads, changed in a later notebook cell, makes
    # another spec (and compiled function), as the client's own trace sees it
    key = (id(layer), layer.fn, layer.fingerprint, treedef, tuple(sig))
    try:
        hit = _INFER_CACHE.get(key)
    except TypeError:  # an unhashable static argument
        bad = next(x for x in leaves if not isinstance(x, Traced) and not is_array(x)
                   and not _hashable(x))
        raise LayerTypeError(
            f"layer {layer.name!r} got an unhashable non-array argument {bad!r} "
            f"({type(bad).__name__}); non-array arguments are static and must be hashable. "
            "Pass arrays for data, or a tuple instead of a list/dict."
        ) from None
    if hit is not None:
        return hit
    kinds = tuple("d" if isinstance(x, Traced) or is_array(x) else "s" for x in leaves)
    statics = tuple(None if k == "d" else x for k, x in zip(kinds, leaves))
    diff = tuple(isinstance(x, Traced) and x.requires_grad
                 for x, k in zip(leaves, kinds) if k == "d")
    spec = make_call_spec(layer, treedef, kinds, statics, diff)
    avals = [jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) if isinstance(x, Traced)
             else aval_of(x) for x, k in zip(leaves, kinds)
             if k == "d"]
    try:
        out = jax.eval_shape(lambda *dyn: spec.call(list(dyn)), *avals)
    except Exception as e:  # re-raised with the layer, stage and shapes
        args, kwargs = jax.tree_util.tree_unflatten(treedef, [_describe(x) for x in leaves])
        shown = ", ".join([*map(_short, args), *(f"{k}={_short(v)}" for k, v in kwargs.items())])
        where = f" on stage {stage}" if stage is not None else ""
        if isinstance(e, LayerTypeError):       # says what is wrong: add where
            raise LayerTypeError(f"layer {layer.name!r}{where}: {e}") from e
        if isinstance(e, CustomRuleError):      # already says what is wrong
            e.add_note(f"dagdiff: while tracing layer {layer.name!r}{where} on arguments "
                       f"({shown})")
            raise
        if isinstance(e, TracerError):       # it closes over a traced value
            raise TracerError(
                f"layer {layer.name!r}{where} uses a traced value it did not get as an "
                f"argument ({getattr(e, 'value', 'see below')}); a layer "
                "sees only its arguments' data: pass the value to the layer as an argument"
            ) from e
        cls = LayerTypeError if isinstance(e, TypeError) and "shape" not in str(e).lower() \
            else LayerShapeError
        raise cls(
            f"layer {layer.name!r}{where} failed at trace time on arguments ({shown}): "
            f"{type(e).__name__}: {e}"
        ) from e
    out_leaves, out_treedef = jax.tree_util.tree_flatten(out)
    out_avals = tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in out_leaves)
    spec = spec.with_outputs(out_avals, avals, out_treedef)
    with _INFER_LOCK:
        if len(_INFER_CACHE) > 4096:
            _INFER_CACHE.clear()
        _INFER_CACHE[key] = (spec, out_treedef, out_avals)
    return spec, out_treedef, out_avals


def _short(x: Any) -> str:
    """An argument as shown in an error: its text, or its type for a long one (a module)."""
    text = str(x)
    return text if len(text) <= 120 else f"<{type(x).__name__}>"


def _hashable(x: Any) -> bool:
    try:
        hash(x)
        return True
    except TypeError:
        return False


def home_stages(trace: Any) -> dict[int, int | None]:
    """Input/param node -> the stage of its first consumer (where its data should live)."""
    home: dict[int, int | None] = {}
    for n in trace.nodes:
        if n.kind != "call":
            continue
        for x in n.in_leaves:
            if isinstance(x, Traced) and trace.nodes[x.node].kind != "call":
                home.setdefault(x.node, n.stage)
    return home
