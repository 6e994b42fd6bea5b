"""User mistakes get errors of the right type that name what is wrong and how to fix it."""
from __future__ import annotations

from typing import Any

import dask
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dagdiff as dd
from dagdiff import CustomRuleError
from tests import models as M

KEY = jax.random.PRNGKey(0)


def data(batch: int = 8) -> tuple[Any, Any, Any]:
    params = M.init_dense(KEY, [4, 8, 3])
    x = jax.random.normal(jax.random.fold_in(KEY, 1), (batch, 4))
    t = jax.random.normal(jax.random.fold_in(KEY, 2), (batch, 3))
    return params, x, t


def loss_fn(params: Any, x: Any, t: Any) -> Any:
    h = x
    for s, p in enumerate(params):
        with dd.stage(s):
            h = M.dense(p, h)
    with dd.stage(1):
        return M.mse(h, t)


def test_integer_parameters_alone_are_refused_like_jax_grad() -> None:
    """Integer leaves among float ones get no gradient (test_core); a differentiated
    argument with no float leaf at all is a mistake, refused as jax.grad refuses it."""
    params, x, t = data()
    ints = jax.tree_util.tree_map(lambda a: a.astype(jnp.int32), params)
    with pytest.raises(TypeError):                       # the reference refuses too
        jax.grad(loss_fn)(ints, x, t)
    with pytest.raises(dd.TracerError, match="nothing to differentiate") as e:
        dd.value_and_grad(loss_fn)(ints, x, t)
    assert "argument 'params' (position 0) holds i32[3], i32[4,8]" in str(e.value)
    assert "astype(jnp.float32)" in str(e.value)


def test_batch_options_are_checked_and_named() -> None:
    params, x, t = data()
    with pytest.raises(dd.MicrobatchError, match="batch_axis=2 but argument 'x' has shape"):
        dd.value_and_grad(loss_fn, microbatches=2, schedule="gpipe", batch_axis=2)(
            params, x, t)
    with pytest.raises(dd.ArgumentError, match="batch_argnums=\\(1, 3\\)"):
        dd.value_and_grad(loss_fn, microbatches=2, batch_argnums=(1, 3))(params, x, t)
    # an int is accepted where jax accepts one (argnums); here only x is split, so t's
    # full batch meets a microbatch of x in the loss layer
    with pytest.raises(dd.LayerShapeError, match="'mse' on stage 1"):
        dd.value_and_grad(loss_fn, microbatches=2, batch_argnums=1)(params, x, t)
    loss, grads = dd.value_and_grad(loss_fn, microbatches=2, batch_argnums=(1, 2))(
        params, x, t)
    want = jax.grad(loss_fn)(params, x, t)
    for a, b in zip(jax.tree_util.tree_leaves(dask.compute(grads, scheduler="sync")[0]),
                    jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_split_argument_cannot_be_differentiated_with_microbatches() -> None:
    """The gradient of an argument split into microbatches came back as one
    microbatch's shape, the sum over the microbatches ((2, 8) for x of (4, 8)), without
    a word; now a clear error at build time. With one microbatch the input gradient is
    the batch's, as jax gives it."""
    params, x, t = data()
    for fn in (dd.value_and_grad, dd.grad):
        with pytest.raises(dd.ArgumentError, match=r"(?s)'x' \(position 1\) is both.*"
                                                   r"microbatches=1"):
            fn(loss_fn, argnums=(0, 1), microbatches=2, schedule="1f1b",
               batch_argnums=(1, 2))(params, x, t)
    _, grads = dd.value_and_grad(loss_fn, argnums=(0, 1), microbatches=1, schedule="1f1b",
                                 batch_argnums=(1, 2))(params, x, t)
    got = dask.compute(grads, scheduler="sync")[0]
    want = jax.grad(loss_fn, argnums=(0, 1))(params, x, t)
    assert np.shape(got[1]) == np.shape(x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_aux_mismatches_say_has_aux() -> None:
    params, x, t = data()

    def with_aux(params: Any, x: Any, t: Any) -> Any:
        h = M.dense(params[0], x)
        return M.mse(M.dense(params[1], h), t), h

    with pytest.raises(dd.TracerError, match="pass has_aux=True"):
        dd.value_and_grad(with_aux)(params, x, t)
    for kw in ({}, {"microbatches": 2, "schedule": "gpipe"}):
        with pytest.raises(dd.TracerError, match="must return a 2-tuple \\(loss, aux\\), got "
                                                 "f32\\[\\]"):
            dd.value_and_grad(loss_fn, has_aux=True, **kw)(params, x, t)
    # dd.Trainer takes no has_aux: its error does not tell you to pass it
    trainer = dd.Trainer(with_aux, optax.sgd(0.1), client=None)
    with pytest.raises(dd.TracerError, match="dd.Trainer trains on a loss function that "
                                             "returns the loss alone") as info:
        trainer.step(trainer.init(params), x, t)
    assert "pass has_aux" not in str(info.value)


def test_microbatches_on_an_unstaged_model_say_it_is_a_pipeline() -> None:
    """microbatches=4 on a model without stages: the error says the microbatches made a
    pipeline and how to accumulate gradients on one stage instead, which then equals
    jax.value_and_grad."""
    params, x, t = data()

    def unstaged(params: Any, x: Any, t: Any) -> Any:
        return M.mse(M.dense(params[1], M.dense(params[0], x)), t)

    with pytest.raises(dd.PlacementError, match=r"microbatches=4 makes the step a pipeline "
                                                r"\(schedule '1f1b'.*pass stages=1"):
        dask.compute(*dd.value_and_grad(unstaged, microbatches=4)(params, x, t),
                     scheduler="sync")
    got, g = dask.compute(*dd.value_and_grad(unstaged, microbatches=4, stages=1)(
        params, x, t), scheduler="sync")
    want, want_g = jax.value_and_grad(unstaged)(params, x, t)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(want_g)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_array_methods_and_comparisons_between_layers_say_to_use_a_layer() -> None:
    params, x, t = data()

    def summed(params: Any, x: Any, t: Any) -> Any:
        return (M.dense(params[0], x) - 1.0).sum()

    with pytest.raises(dd.TracerError, match="has no .sum\\(\\) outside a layer"):
        dd.value_and_grad(summed)(params, x, t)

    def branches(params: Any, x: Any, t: Any) -> Any:
        h = M.dense(params[0], x)
        if h[0, 0] > 0:
            h = -h
        return M.mse(M.dense(params[1], h), t)

    with pytest.raises(dd.TracerError, match="A comparison"):
        dd.value_and_grad(branches)(params, x, t)


def _overflow_fwd(x: Any) -> Any:
    x = np.asarray(x)
    if np.all(np.isfinite(x)) and x.size > 0 and not np.all(x == 0):   # not the zeros
        raise FloatingPointError("overflow in the user's kernel")     # shapes are traced on
    return np.exp(x), x


def _overflow_bwd(res: Any, ct: Any) -> Any:
    return (np.exp(res) * ct,)


_explodes = dd.custom_layer(_overflow_fwd, _overflow_bwd, name="explodes")


def test_a_layer_failing_at_run_time_names_layer_stage_and_microbatch() -> None:
    params, x, t = data()

    def fails(params: Any, x: Any, t: Any) -> Any:
        with dd.stage(0):
            h = M.dense(params[0], x)
        with dd.stage(1):
            return M.mse(M.dense(params[1], _explodes(h)), t)

    loss, _ = dd.value_and_grad(fails, microbatches=2, schedule="gpipe")(params, x, t)
    with pytest.raises(Exception, match="overflow") as e:
        dask.compute(loss, scheduler="sync")
    notes = "\n".join(getattr(e.value, "__notes__", []))
    assert "forward of layer 'explodes' (stage 1, microbatch" in notes, notes
    assert "float32[4, 8]" in notes


def test_a_layer_closing_over_a_traced_value_says_to_pass_it() -> None:
    params, x, t = data()

    def closes_over(params: Any, x: Any, t: Any) -> Any:
        h0 = M.dense(params[0], x)

        @dd.layer
        def skip(h: Any) -> Any:
            return h + h0                              # h0 is not an argument

        return M.mse(M.dense(params[1], skip(h0)), t)

    with pytest.raises(dd.TracerError, match="layer 'skip' uses a traced value it did not "
                                             "get as an argument") as e:
        dd.value_and_grad(closes_over)(params, x, t)
    assert "f32[8,8] (output of call 'dense')" in str(e.value)


def test_trainer_misuse_is_named() -> None:
    params, x, t = data()
    with pytest.raises(dd.ArgumentError, match="optax GradientTransformation"):
        dd.Trainer(loss_fn, None)
    with pytest.raises(dd.ArgumentError, match="microbatches must be a positive int"):
        dd.Trainer(loss_fn, optax.sgd(0.1), microbatches=True)
    trainer = dd.Trainer(loss_fn, optax.sgd(0.1), client=None)
    trainer.init(params)
    with pytest.raises(dd.ArgumentError, match="takes the TrainState"):
        trainer.step(params, x, t)
    with pytest.raises(dd.ArgumentError, match="batch 0 is a ArrayImpl|batch 0 is a"):
        trainer.fit([x], state=trainer.init(params), progress=False)


def test_record_wants_a_client() -> None:
    with pytest.raises(TypeError, match="dd.record takes a distributed Client"):
        with dd.record("tcp://127.0.0.1:1"):
            pass


def test_a_layer_name_given_as_the_function_gets_a_hint() -> None:
    with pytest.raises(TypeError, match="dd.layer\\(name='enc'\\) as a decorator"):
        dd.layer("enc")


def test_silent_gaps_warn() -> None:
    params, x, t = data()
    trainer = dd.Trainer(loss_fn, optax.sgd(0.1), client=None)
    with pytest.warns(UserWarning, match="ran out after 1 of steps=3"):
        trainer.fit([(x, t)], state=trainer.init(params), steps=3, progress=False)
    with pytest.warns(UserWarning, match="stage\\(s\\) \\[7\\] that the model does not have"):
        dd.value_and_grad(loss_fn, placement={7: 0})(params, x, t)


def test_a_shape_error_in_a_pipeline_says_what_was_split() -> None:
    params, x, t = data()
    with pytest.raises(dd.LayerShapeError, match="'mse' on stage 1") as e:
        dd.value_and_grad(loss_fn, microbatches=2, schedule="gpipe")(params, x, t=t)
    notes = "\n".join(e.value.__notes__)
    assert "split into 2 microbatches along axis 0: 'x'" in notes
    assert "every microbatch: 'params', t= (differentiated arguments and keyword arguments are " \
        "never split" in notes
    # a batch argument differentiated beside the parameters is not split either
    with pytest.raises(dd.LayerShapeError, match="'mse' on stage 1") as e:
        dd.value_and_grad(loss_fn, argnums=(0, 1), microbatches=2, schedule="gpipe")(
            params, x, t)
    notes = "\n".join(e.value.__notes__)
    assert "split into 2 microbatches along axis 0: 't'; passed whole to every " \
        "microbatch: 'params', 'x' (differentiated arguments" in notes, notes
    assert "take a batch argument's gradient without microbatches" in notes


def test_a_custom_fwd_without_residuals_is_named() -> None:
    sin = dd.custom_layer(lambda x: np.sin(np.asarray(x)),            # forgot the residuals
                          lambda res, ct: (np.cos(res) * ct,), name="np_sin")
    want = "'np_sin': fwd must return \\(out, residuals\\), got ndarray"
    with pytest.raises(CustomRuleError, match=want):
        dd.value_and_grad(lambda p, x: M.mse(sin(p), x))(jnp.ones((2, 3)), jnp.ones((2, 3)))


def test_a_missing_or_corrupt_checkpoint_is_named(tmp_path: Any) -> None:
    with pytest.raises(dd.CheckpointError, match="no checkpoint directory at"):
        dd.load(str(tmp_path / "nowhere"))
    params, x, t = data()
    tr = dd.Trainer(loss_fn, optax.sgd(0.1))
    state = tr.init(params)
    dd.save(str(tmp_path / "ckpt"), state, tr)
    for f in (tmp_path / "ckpt").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\xff\xfe not a checkpoint \x00" * 8)
    with pytest.raises(dd.CheckpointError, match="not a readable dd.save checkpoint") as e:
        dd.load(str(tmp_path / "ckpt"))
    assert "ckpt" in str(e.value) and isinstance(e.value, ValueError)


def test_save_does_not_overwrite_what_is_not_a_checkpoint(tmp_path: Any) -> None:
    """`dd.save` to a path holding a file, or a directory of other files, is refused with
    the path named (orbax's overwrite deleted them); saving again to a checkpoint's own
    path replaces it, and loads back."""
    params, x, t = data()
    tr = dd.Trainer(loss_fn, optax.sgd(0.1))
    state = tr.init(params)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(dd.CheckpointError, match="notes.txt.*is a file"):
        dd.save(str(tmp_path / "notes.txt"), state, tr)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(dd.CheckpointError, match="holds other files") as e:
        dd.save(str(tmp_path), state, tr)
    assert isinstance(e.value, ValueError) and (tmp_path / "notes.txt").exists()
    (tmp_path / "empty").mkdir()
    dd.save(str(tmp_path / "empty"), state, tr)              # an empty directory is fine
    state, _ = tr.step(state, x, t)
    dd.save(str(tmp_path / "empty"), state, tr)              # a checkpoint saved again
    assert dd.load(str(tmp_path / "empty")).step == 1
    # not a TrainState (the parameters, the arguments swapped): said, nothing written
    with pytest.raises(dd.ArgumentError, match="takes a dd.TrainState.*got list"):
        dd.save(str(tmp_path / "params"), params)
    with pytest.raises(dd.ArgumentError, match="other way round"):
        dd.save(state, str(tmp_path / "swapped"))               # type: ignore[arg-type]
    assert not (tmp_path / "params").exists() and not (tmp_path / "swapped").exists()


@pytest.mark.distributed
def test_a_step_on_a_closed_client_says_so(client2: Any) -> None:
    from distributed import Client

    params, x, t = data()
    other = Client(client2.scheduler.address, set_as_default=False)
    tr = dd.Trainer(loss_fn, optax.sgd(0.1), microbatches=2, schedule="1f1b", client=other)
    state = tr.init(params)
    other.close()
    with pytest.raises(dd.ClientClosedError,
                       match="(?s)is closed: make a new one.*a dd.Trainer keeps the client"):
        tr.step(state, x, t)
    with pytest.raises(dd.ClientClosedError, match="is closed"):
        with other.as_current():
            dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b")(params, x, t)


def test_a_string_as_params_is_named() -> None:
    _, x, t = data()
    with pytest.raises(dd.TracerError, match="argument 'params' \\(position 0\\) holds str"):
        dd.value_and_grad(loss_fn)("weights.npz", x, t)


@dd.layer
def _scaled_with(p: Any, x: Any, guard: Any) -> Any:
    return jnp.tanh(x @ p["w"] + p["b"])


def _loss_with(params: Any, x: Any, t: Any, guard: Any) -> Any:
    with dd.stage(0):
        h = _scaled_with(params[0], x, guard)
    with dd.stage(1):
        return M.mse(M.dense(params[1], h), t)


class _RaisesOnUnpickle:
    """Pickles, but its unpickling raises (as a jax.custom_vjp object does)."""

    scale = 1.0

    def __reduce__(self) -> Any:
        return (_refuse, ())


def _refuse() -> Any:
    raise RuntimeError("cannot be rebuilt here")


_ONE_WAY = _RaisesOnUnpickle()


@jax.custom_vjp
def _identity_vjp(y: Any) -> Any:
    return y


_identity_vjp.defvjp(lambda y: (y, None), lambda _, ct: (ct,))


def _one_way_layer(kind: str) -> Any:
    if kind == "reduce":
        def one_way(p: Any, x: Any) -> Any:
            return jnp.tanh(x @ p["w"] + p["b"]) * _ONE_WAY.scale
    else:
        def one_way(p: Any, x: Any) -> Any:
            return _identity_vjp(jnp.tanh(x @ p["w"] + p["b"]))
    return dd.layer(one_way, name="one_way")


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["reduce", "custom_vjp"])
def test_a_layer_that_does_not_unpickle_is_named_and_the_workers_stay(client2: Any,
                                                                      kind: str) -> None:
    """A layer whose function pickles but cannot be rebuilt from its bytes (it uses a
    jax.custom_vjp function, or an object whose unpickling raises): on a worker its
    task did not deserialize, distributed dropped the worker (every worker of the step,
    the cluster left with none) and step.compute waited for workers. The build now
    rebuilds each layer's bytes once and names the layer and its stage; the workers
    stay, and the same model with a plain layer computes."""
    layer = _one_way_layer(kind)

    def loss(params: Any, x: Any, t: Any) -> Any:
        with dd.stage(0):
            h = M.dense(params[0], x)
        with dd.stage(1):
            return M.mse(layer(params[1], h), t)

    params = M.init_dense(jax.random.PRNGKey(0), [4, 4, 4])
    x, t = jnp.ones((4, 4)), jnp.zeros((4, 4))
    with client2.as_current():
        with pytest.raises(dd.LayerTypeError) as e:
            dd.value_and_grad(loss, microbatches=2, schedule="1f1b").compute(params, x, t)
    msg = str(e.value)
    assert "'one_way'" in msg and "stage 1" in msg and "cannot be rebuilt" in msg
    assert len(client2.scheduler_info()["workers"]) == 2
    with client2.as_current():
        got = dd.value_and_grad(loss_fn, microbatches=2, schedule="1f1b").compute(
            params, x, t)
    np.testing.assert_allclose(got[0], jax.value_and_grad(loss_fn)(params, x, t)[0],
                               rtol=1e-5)


@pytest.mark.distributed
def test_an_unpicklable_layer_argument_is_named_before_dask_fails(client2: Any) -> None:
    """A threading.Lock passed to a layer: on a cluster the build names the layer, its
    stage, the argument and what could not be pickled (Dask's own error names only its
    graph type); on local threads, which pickle nothing, the step runs."""
    import threading

    params = M.init_dense(jax.random.PRNGKey(0), [4, 4, 4])
    x, t = jnp.ones((4, 4)), jnp.zeros((4, 4))
    lock = threading.Lock()
    with client2.as_current():
        for kw in ({}, {"microbatches": 2, "schedule": "1f1b"}):
            with pytest.raises(dd.LayerTypeError) as e:
                dd.value_and_grad(_loss_with, **kw)(params, x, t, lock)
            msg = str(e.value)
            assert "'scaled_with'" in msg and "stage 0" in msg and "'guard'" in msg
            assert "_thread.lock" in msg and "cannot pickle" in msg
        with pytest.raises(dd.LayerTypeError, match="'guard'"):
            dd.Trainer(_loss_with, optax.sgd(0.1), microbatches=2, schedule="1f1b",
                       client=client2).init(params, x, t, lock)
    loss, _ = dask.compute(*dd.value_and_grad(_loss_with)(params, x, t, lock),
                           scheduler="threads")
    np.testing.assert_allclose(loss, jax.value_and_grad(
        lambda p: _loss_with(p, x, t, None))(params)[0], rtol=1e-5)


def test_a_custom_bwd_returning_a_list_or_a_float_is_read_or_named() -> None:
    """Regression: a bwd rule returning a Python list (or float) for an array argument
    raised a bare AttributeError ('list' object has no attribute 'dtype'). A list of the
    argument's shape is read as NumPy reads it (equal to jax); a float for a vector
    argument is a CustomRuleError naming the layer and both shapes; a dict argument's
    count mismatch says cotangents go one per leaf."""
    import dask

    def fwd(w: Any, x: Any) -> Any:
        return np.asarray(x) * np.asarray(w), (np.asarray(w), np.asarray(x))

    def as_list(res: Any, ct: Any) -> Any:
        w, x = res
        return (np.asarray(ct) * x).sum(0).tolist(), (np.asarray(ct) * w).tolist()

    def as_float(res: Any, ct: Any) -> Any:
        return float(np.sum(ct)), float(np.sum(ct))

    w, x = jnp.arange(1.0, 5.0), jnp.ones((3, 4))
    want = jax.grad(lambda w: jnp.sum((x * w) ** 2))(w)
    scale = dd.custom_layer(fwd, as_list, name="scale")
    _, g = dask.compute(*dd.value_and_grad(lambda w, x: M.mse(scale(w, x), 0 * x))(w, x),
                        scheduler="sync")
    np.testing.assert_allclose(g, want / 12, rtol=1e-5)
    bad = dd.custom_layer(fwd, as_float, name="scale_float")
    with pytest.raises(CustomRuleError, match=r"'scale_float'.*float\d*\[\] for argument 0 of "
                                              r"float32\[4\]"):
        dask.compute(*dd.value_and_grad(lambda w, x: M.mse(bad(w, x), 0 * x))(w, x),
                     scheduler="sync")
    two = dd.custom_layer(lambda p, x: (np.asarray(x) * np.asarray(p["a"]) + np.asarray(p["w"]),
                                        None),
                          lambda res, ct: ({"a": ct, "w": ct}, ct), name="dict_arg")
    with pytest.raises(CustomRuleError, match="one per leaf.*dict keys sorted"):
        dask.compute(*dd.value_and_grad(lambda p, x: M.mse(two(p, x), 0 * x))(
            {"a": jnp.ones(4), "w": jnp.ones(4)}, x), scheduler="sync")
