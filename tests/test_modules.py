"""Flax NNX, Equinox and Flax Linen modules as layers, differentiated arguments and Trainer
models, each against the library's own gradient or training loop."""
from __future__ import annotations

from typing import Any

import dask
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dagdiff as dd
from dagdiff.lowering.collection import DelayedTree

nnx = pytest.importorskip("flax.nnx")
eqx = pytest.importorskip("equinox")
linen = pytest.importorskip("flax.linen")

D = 6


def rand(i: int, shape: tuple[int, ...]) -> Any:
    return jax.random.normal(jax.random.key(i), shape)


def assert_same(got: Any, want: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


@dd.layer(name="mse", stage=1)
def mse(y: Any, t: Any) -> Any:
    return jnp.mean((y - t) ** 2)


# --- Flax NNX ---------------------------------------------------------------------------
class Block(nnx.Module):
    def __init__(self, d: int, rngs: Any) -> None:
        self.lin = nnx.Linear(d, d, rngs=rngs)
        self.scale = 0.5                              # a static attribute

    def __call__(self, x: Any) -> Any:
        return jnp.tanh(self.lin(x)) * self.scale + x


class Net(nnx.Module):
    """A model whose blocks are called in order (the user's own class)."""

    def __init__(self, rngs: Any, n: int = 4) -> None:
        self.blocks = nnx.List([Block(D, rngs) for _ in range(n)])

    def __call__(self, x: Any) -> Any:
        for b in self.blocks:
            x = b(x)
        return x


def nnx_loss(model: Any, x: Any, t: Any) -> Any:
    """The model's blocks as layers, two stages of two blocks."""
    for i, block in enumerate(model.blocks):
        x = dd.layer(block, stage=i // 2)(x)
    return mse(x, t)


def nnx_ref(model: Any, x: Any, t: Any) -> Any:
    return jnp.mean((model(x) - t) ** 2)


@pytest.mark.distributed
def test_step_compute_on_a_cluster_gives_an_nnx_models_grads_as_an_nnx_state(
        client2: Any) -> None:
    """`step.compute` on a cluster (direct dispatch: each worker's outputs gathered in one
    task) gives the gradients in the module's own form, equal to nnx.value_and_grad's."""
    model, x, t = Net(nnx.Rngs(0)), rand(1, (8, D)), rand(2, (8, D))
    want_loss, want = nnx.value_and_grad(nnx_ref)(model, x, t)
    step = dd.value_and_grad(nnx_loss, microbatches=4, schedule="1f1b")
    got_loss, got = step.compute(model, x, t, client=client2)
    assert isinstance(got, nnx.State)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pipeline", [{}, {"microbatches": 4, "schedule": "1f1b"}])
def test_nnx_model_grads_are_an_nnx_state_equal_to_nnx_value_and_grad(pipeline: Any) -> None:
    model, x, t = Net(nnx.Rngs(0)), rand(1, (8, D)), rand(2, (8, D))
    want_loss, want = nnx.value_and_grad(nnx_ref)(model, x, t)
    loss, grads = dd.value_and_grad(nnx_loss, **pipeline)(model, x, t)
    assert isinstance(grads, DelayedTree)
    got_loss, got = dask.compute(loss, grads)
    assert isinstance(got, nnx.State)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_same(got, want)
    # persisted, the gradients stay one collection and compute to the same State
    (kept,) = dask.persist(grads, scheduler="threads")
    assert isinstance(kept, DelayedTree)
    assert_same(dask.compute(kept)[0], want)
    assert isinstance(grads.delayed, nnx.State)        # its Delayed leaves, to pick from
    # the model given is left as it was: nothing of the trace leaks into it
    assert all(isinstance(v, jax.Array) for v in jax.tree_util.tree_leaves(model))


def test_the_same_loss_function_for_nnx_and_dagdiff_and_a_plain_one_as_one_layer() -> None:
    model, x, t = Net(nnx.Rngs(0)), rand(1, (8, D)), rand(2, (8, D))
    # the loss with dd.layer calls runs eagerly under nnx.value_and_grad as well
    want_loss, want = nnx.value_and_grad(nnx_loss)(model, x, t)
    got_loss, got = dask.compute(*dd.value_and_grad(nnx_loss)(model, x, t))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_same(got, want)
    # a plain NNX loss (no dd.layer anywhere) runs as one layer: one forward, one VJP task
    graph = dd.trace(nnx_ref)(model, x, t)
    assert [n.name for n in graph.trace.nodes if n.kind == "call"] == ["nnx_ref"]
    want_loss, want = nnx.value_and_grad(nnx_ref)(model, x, t)
    got_loss, got = dask.compute(*dd.value_and_grad(nnx_ref)(model, x, t))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_same(got, want)


def test_nnx_layers_stored_in_the_model_and_a_sequential_split_into_stages() -> None:
    class Stored(nnx.Module):          # dd.layer inside the model: the loss calls model(x)
        def __init__(self, rngs: Any) -> None:
            self.blocks = nnx.List([dd.layer(Block(D, rngs), stage=i) for i in range(2)])

        def __call__(self, x: Any) -> Any:
            for b in self.blocks:
                x = b(x)
            return x

    x, t = rand(1, (8, D)), rand(2, (8, D))
    stored = Stored(nnx.Rngs(0))
    want_loss, want = nnx.value_and_grad(nnx_ref)(stored, x, t)   # the layers run eagerly
    got_loss, got = dd.value_and_grad(lambda m, x, t: mse(m(x), t), microbatches=2,
                                      schedule="gpipe")(stored, x, t)
    got_loss, got = dask.compute(got_loss, got)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_same(got, want)

    seq = nnx.Sequential(nnx.Linear(D, 8, rngs=nnx.Rngs(1)), jax.nn.relu,
                         nnx.Linear(8, D, rngs=nnx.Rngs(2)))

    def seq_loss(m: Any, x: Any, t: Any) -> Any:
        return dd.layer(lambda y, t: jnp.mean((y - t) ** 2), name="mse")(
            dd.layer(m, name="seq")(x), t)

    graph = dd.trace(seq_loss, stages=2)(seq, x, t)
    calls = [n for n in graph.trace.nodes if n.kind == "call"]
    assert [n.name for n in calls] == ["seq_0", "seq_1", "seq_2", "mse"]
    assert {n.stage for n in calls} == {0, 1}
    want_loss, want = nnx.value_and_grad(nnx_ref)(seq, x, t)
    got_loss, got = dask.compute(*dd.value_and_grad(seq_loss, stages=2)(seq, x, t))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_same(got, want)


def test_nnx_state_that_changes_in_a_call_is_refused_and_eval_mode_works() -> None:
    class WithStats(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.lin = nnx.Linear(D, D, rngs=rngs)
            self.bn = nnx.BatchNorm(D, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.drop(self.bn(self.lin(x)))

    model, x, t = WithStats(nnx.Rngs(0)), rand(1, (8, D)), rand(2, (8, D))

    def loss(m: Any, x: Any, t: Any) -> Any:
        return mse(dd.layer(m, name="block", stage=0)(x), t)

    with pytest.raises(dd.LayerTypeError) as info:
        dd.value_and_grad(loss)(model, x, t)
    text = str(info.value)
    assert "block" in text and "WithStats" in text and "BatchStat" in text
    assert "RngCount" in text and "use_running_average=True" in text
    model.eval()                       # running averages, no dropout: a pure function
    want_loss, want = nnx.value_and_grad(nnx_ref)(model, x, t)
    got_loss, got = dask.compute(*dd.value_and_grad(loss)(model, x, t))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_same(got, want)


def nnx_reference_training(batches: list[Any], opt: Any) -> Any:
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, opt, wrt=nnx.Param)
    losses = []
    for x, t in batches:
        loss, grads = nnx.value_and_grad(nnx_ref)(model, x, t)
        optimizer.update(model, grads)
        losses.append(float(loss))
    return model, losses


def test_trainer_trains_an_nnx_model_as_nnx_and_optax_do() -> None:
    batches = [(rand(10 + i, (8, D)), rand(20 + i, (8, D))) for i in range(4)]
    want, want_losses = nnx_reference_training(batches, optax.adam(1e-2))
    trainer = dd.Trainer(nnx_loss, optax.adam(1e-2), microbatches=2, schedule="1f1b")
    state = trainer.init(Net(nnx.Rngs(0)))
    losses = []
    for x, t in batches:
        state, loss = trainer.step(state, x, t)
        losses.append(float(np.asarray(dask.compute(loss)[0])))
    got = trainer.params(state)
    assert type(got) is Net
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_same(nnx.state(got, nnx.Param), nnx.state(want, nnx.Param))
    assert got(batches[0][0]).shape == (8, D)           # a working model of the user's class


# --- Equinox ----------------------------------------------------------------------------
class EqxBlock(eqx.Module):
    lin: Any
    act: Any                          # a function: a non-array leaf, held fixed
    depth: int = eqx.field(static=True)

    def __init__(self, key: Any) -> None:
        self.lin = eqx.nn.Linear(D, D, key=key)
        self.act = jax.nn.tanh
        self.depth = 1

    def __call__(self, x: Any) -> Any:
        return self.act(self.lin(x)) + x


class EqxNet(eqx.Module):
    blocks: tuple[Any, ...]

    def __init__(self, key: Any, n: int = 4) -> None:
        self.blocks = tuple(EqxBlock(k) for k in jax.random.split(key, n))

    def __call__(self, x: Any) -> Any:
        for b in self.blocks:
            x = b(x)
        return x


def eqx_loss(model: Any, x: Any, t: Any) -> Any:
    for i, block in enumerate(model.blocks):
        x = dd.layer(eqx.filter_vmap(block), name="block", stage=i // 2)(x)
    return mse(x, t)


def eqx_ref(model: Any, x: Any, t: Any) -> Any:
    return jnp.mean((jax.vmap(model)(x) - t) ** 2)


@pytest.mark.parametrize("pipeline", [{}, {"microbatches": 2, "schedule": "1f1b"}])
def test_eqx_model_grads_are_module_shaped_as_filter_value_and_grad(pipeline: Any) -> None:
    model, x, t = EqxNet(jax.random.key(0)), rand(1, (8, D)), rand(2, (8, D))
    want_loss, want = eqx.filter_value_and_grad(eqx_ref)(model, x, t)
    loss, grads = dd.value_and_grad(eqx_loss, **pipeline)(model, x, t)
    got_loss, got = dask.compute(loss, grads)
    assert type(got) is EqxNet and got.blocks[0].act is None     # None where not inexact
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_same(got, want)


class EqxKeyed(eqx.Module):
    """A block holding a typed PRNG key (for its dropout, say): not a float array."""
    lin: Any
    key: Any

    def __init__(self, key: Any) -> None:
        self.lin = eqx.nn.Linear(D, D, key=key)
        self.key = jax.random.key(7)

    def __call__(self, x: Any) -> Any:
        return jnp.tanh(self.lin(x))


def test_an_eqx_module_holding_a_typed_key_is_differentiated_and_trained() -> None:
    """A typed key (``key<fry>``) among an Equinox module's fields is held fixed, as
    Equinox's filters do; dagdiff failed on it ("Cannot interpret 'key<fry>' as a data
    type") in `value_and_grad` and `Trainer.init`. Equal to equinox + optax."""
    model, x, t = EqxKeyed(jax.random.key(0)), rand(1, (8, D)), rand(2, (8, D))

    def loss(m: Any, x: Any, t: Any) -> Any:
        return mse(dd.layer(eqx.filter_vmap(m), name="keyed")(x), t)

    def ref(m: Any, x: Any, t: Any) -> Any:
        return jnp.mean((jax.vmap(m)(x) - t) ** 2)

    want_loss, want = eqx.filter_value_and_grad(ref)(model, x, t)
    got_loss, got = dask.compute(*dd.value_and_grad(loss)(model, x, t))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert got.key is None
    assert_same(got.lin, want.lin)

    opt = optax.adam(1e-2)
    params = eqx.filter(model, eqx.is_inexact_array)
    opt_state = opt.init(params)
    for _ in range(2):
        grads = eqx.filter_grad(ref)(model, x, t)
        updates, opt_state = opt.update(grads, opt_state, params)
        model = eqx.apply_updates(model, updates)
        params = eqx.filter(model, eqx.is_inexact_array)
    trainer = dd.Trainer(loss, opt)
    state = trainer.init(EqxKeyed(jax.random.key(0)))
    for _ in range(2):
        state, _ = trainer.step(state, x, t)
    got = trainer.params(state)
    assert type(got) is EqxKeyed and jax.random.key_data(got.key).tolist() == \
        jax.random.key_data(jax.random.key(7)).tolist()
    assert_same(got.lin, model.lin)


def test_eqx_sequential_as_one_layer_and_a_module_as_a_plain_layer() -> None:
    keys = jax.random.split(jax.random.key(3), 2)
    seq = eqx.nn.Sequential([eqx.nn.Linear(D, 8, key=keys[0]), eqx.nn.Lambda(jax.nn.relu),
                             eqx.nn.Linear(8, D, key=keys[1])])
    x, t = rand(1, (D,)), rand(2, (D,))

    def loss(m: Any, x: Any, t: Any) -> Any:
        return dd.layer(lambda y, t: jnp.mean((y - t) ** 2), name="mse")(dd.layer(m)(x), t)

    want_loss, want = eqx.filter_value_and_grad(
        lambda m, x, t: jnp.mean((m(x) - t) ** 2))(seq, x, t)
    graph = dd.trace(loss)(seq, x, t)
    assert [n.name for n in graph.trace.nodes if n.kind == "call"] == [
        "sequential_0", "sequential_1", "sequential_2", "mse"]
    got_loss, got = dask.compute(*dd.value_and_grad(loss)(seq, x, t))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_same(got, want)


def test_trainer_trains_an_eqx_model_as_equinox_and_optax_do() -> None:
    batches = [(rand(10 + i, (8, D)), rand(20 + i, (8, D))) for i in range(4)]
    opt = optax.sgd(0.1, momentum=0.9)
    model = EqxNet(jax.random.key(0))
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    want_losses = []
    for x, t in batches:
        loss, grads = eqx.filter_value_and_grad(eqx_ref)(model, x, t)
        updates, opt_state = opt.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        want_losses.append(float(loss))
    trainer = dd.Trainer(eqx_loss, opt, microbatches=2, schedule="1f1b")
    state = trainer.init(EqxNet(jax.random.key(0)))
    losses = []
    for x, t in batches:
        state, loss = trainer.step(state, x, t)
        losses.append(float(np.asarray(dask.compute(loss)[0])))
    got = trainer.params(state)
    assert type(got) is EqxNet and got.blocks[0].act is jax.nn.tanh
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_same(eqx.filter(got, eqx.is_inexact_array), eqx.filter(model, eqx.is_inexact_array))


def test_trainer_trains_a_list_of_eqx_blocks_as_equinox_and_optax_do() -> None:
    """A model as a list of Equinox blocks (each with its activation function as a
    leaf): dd.Trainer refused it ("parameters must be float arrays; leaf 4 is
    PjitFunction") where dd.value_and_grad took it; it trains as equinox + optax now and
    `params` gives the list back with its functions."""
    keys = jax.random.split(jax.random.key(5), 2)
    blocks = [eqx.nn.MLP(D, 8, 8, 1, activation=jax.nn.tanh, key=keys[0]),
              eqx.nn.MLP(8, D, 8, 1, key=keys[1])]
    batches = [(rand(30 + i, (8, D)), rand(40 + i, (8, D))) for i in range(3)]

    def loss_fn(model: Any, x: Any, t: Any) -> Any:
        for i, b in enumerate(model):
            x = dd.layer(eqx.filter_vmap(b), name="block", stage=i)(x)
        return mse(x, t)

    def ref(model: Any, x: Any, t: Any) -> Any:
        for b in model:
            x = jax.vmap(b)(x)
        return jnp.mean((x - t) ** 2)

    opt = optax.adam(1e-2)
    params, static = eqx.partition(blocks, eqx.is_inexact_array)
    opt_state = opt.init(params)
    for x, t in batches:
        grads = eqx.filter_grad(ref)(eqx.combine(params, static), x, t)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = eqx.apply_updates(params, updates)
    trainer = dd.Trainer(loss_fn, opt, microbatches=2, schedule="1f1b")
    state = trainer.init(blocks)
    for x, t in batches:
        state, loss = trainer.step(state, x, t)
    got = trainer.params(state)
    assert type(got) is list and got[0].activation is jax.nn.tanh
    assert_same(eqx.filter(got, eqx.is_inexact_array), params)


# --- Flax Linen -------------------------------------------------------------------------
class LinenMLP(linen.Module):
    width: int

    @linen.compact
    def __call__(self, x: Any) -> Any:
        return linen.Dense(D)(jnp.tanh(linen.Dense(self.width)(x)))


def test_linen_module_as_a_layer_called_with_its_variables() -> None:
    module = LinenMLP(width=8)
    x, t = rand(1, (8, D)), rand(2, (8, D))
    variables = [module.init(jax.random.key(i), x) for i in range(2)]
    layers = [dd.layer(module, name="mlp", stage=i) for i in range(2)]

    def loss(vs: Any, x: Any, t: Any) -> Any:
        for layer, v in zip(layers, vs):
            x = layer(v, x)
        return mse(x, t)

    def ref(vs: Any, x: Any, t: Any) -> Any:
        for v in vs:
            x = module.apply(v, x)
        return jnp.mean((x - t) ** 2)

    want_loss, want = jax.value_and_grad(ref)(variables, x, t)
    got_loss, got = dask.compute(*dd.value_and_grad(loss, microbatches=2,
                                                    schedule="1f1b")(variables, x, t))
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_same(got, want)


# --- on a cluster -----------------------------------------------------------------------
@pytest.mark.distributed
def test_nnx_and_eqx_pipelines_on_the_cluster(client2: Any) -> None:
    x, t = rand(1, (8, D)), rand(2, (8, D))
    with client2.as_current():
        model = Net(nnx.Rngs(0))
        want_loss, want = nnx.value_and_grad(nnx_ref)(model, x, t)
        step = dd.value_and_grad(nnx_loss, microbatches=2, schedule="1f1b")
        for _ in range(2):                           # the same step computed twice
            got_loss, got = step.compute(model, x, t)
            np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
            assert_same(got, want)
        loss, grads = step(model, x, t)
        got_loss, got = client2.compute([loss, grads], sync=True)
        assert isinstance(got, nnx.State)
        assert_same(got, want)
        emodel = EqxNet(jax.random.key(0))
        want_loss, want = eqx.filter_value_and_grad(eqx_ref)(emodel, x, t)
        got_loss, got = dd.value_and_grad(eqx_loss, microbatches=2,
                                          schedule="1f1b").compute(emodel, x, t)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
        assert_same(got, want)


def test_an_nnx_module_sharing_a_submodule_is_refused_with_the_reason() -> None:
    class Tied(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.a = nnx.Linear(D, D, rngs=rngs)
            self.b = self.a                           # the same Linear twice

        def __call__(self, x: Any) -> Any:
            return self.b(self.a(x))

    x, t = rand(1, (8, D)), rand(2, (8, D))
    with pytest.raises(dd.ArgumentError, match="Tied module shares variables"):
        dd.value_and_grad(lambda m, x, t: mse(dd.layer(m, stage=0)(x), t))(Tied(nnx.Rngs(0)),
                                                                          x, t)
