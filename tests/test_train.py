"""Training: Trainer vs plain JAX + optax, replicas, no param traffic to the client,
checkpoints with exact resume, the multimodal example, the main command."""
from __future__ import annotations

from typing import Any

import dask
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dagdiff as dd
from tests import models as M

KEY = jax.random.PRNGKey(11)


def loss_fn(params: Any, x: Any, t: Any) -> Any:
    h = x
    for s in range(2):
        with dd.stage(s):
            h = M.dense(params[s], h)
    with dd.stage(1):
        return M.mse(h, t)


def setup(n_batches: int = 3) -> tuple[Any, list[Any]]:
    params = M.init_dense(KEY, [6, 8, 4])
    batches = [(jax.random.normal(jax.random.fold_in(KEY, i), (16, 6)),
                jax.random.normal(jax.random.fold_in(KEY, 100 + i), (16, 4)))
               for i in range(n_batches)]
    return params, batches


def reference(params: Any, batches: list[Any], opt: Any, fn: Any = None
              ) -> tuple[Any, list[float]]:
    state = opt.init(params)
    losses = []
    fn = fn or loss_fn

    @jax.jit
    def step(p: Any, s: Any, x: Any, t: Any) -> Any:
        loss, g = jax.value_and_grad(fn)(p, x, t)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    for x, t in batches:
        params, state, loss = step(params, state, x, t)
        losses.append(float(loss))
    return params, losses


def close(a: Any, b: Any, rtol: float = 1e-5) -> None:
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=1e-6)


def test_trainer_local_matches_optax() -> None:
    params, batches = setup()
    opt = optax.adam(1e-2)
    want, want_losses = reference(params, batches, opt)
    trainer = dd.Trainer(loss_fn, opt, microbatches=4, schedule="1f1b")
    trainer.init(params)
    state, losses = trainer.fit(batches, progress=False)   # from the latest state
    close(trainer.params(state), want)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)




def _one_stage(params: Any, x: Any, t: Any) -> Any:
    h = x
    for p in params:
        h = M.dense(p, h)
    return M.mse(h, t)


def _pipe(stages: int) -> dict[str, Any]:
    return {"microbatches": 2, "schedule": "1f1b"} if stages == 2 else {}


@pytest.mark.parametrize("stages", [1, 2])
def test_a_mask_reading_the_parameters_paths_is_refused_and_one_of_leaves_trains(
        stages: int) -> None:
    """Regression: `optax.adamw(..., mask=f)` with `f` reading the tree's paths (decay
    weights, not biases) trained as if every leaf were decayed, with no error: dagdiff
    applies the optimizer to a list of each stage's leaves, where there are no paths.
    Now refused, naming the leaf and the fix; a mask of each leaf alone (the fix) and
    `optax.multi_transform` with such labels equal optax on the tree."""
    params, batches = setup()
    fn = loss_fn if stages == 2 else _one_stage

    def by_path(p: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda kp, _: not jax.tree_util.keystr(kp).endswith("['b']"), p)

    labels = (lambda p: jax.tree_util.tree_map_with_path(
        lambda kp, _: "sgd" if jax.tree_util.keystr(kp).endswith("['b']") else "adam", p))
    for opt in (optax.adamw(1e-2, weight_decay=0.5, mask=by_path),
                optax.multi_transform({"adam": optax.adam(1e-2), "sgd": optax.sgd(0.0)},
                                      labels)):
        trainer = dd.Trainer(fn, opt, **_pipe(stages))
        state = trainer.init(params)
        with pytest.raises(dd.OptimizerError, match=r"(?s)place in the tree.*\['b'\].*Fix"):
            trainer.step(state, *batches[0])
    opt = optax.adamw(1e-2, weight_decay=0.5,
                      mask=lambda p: jax.tree_util.tree_map(lambda x: x.ndim > 1, p))
    want, want_losses = reference(params, batches, opt, fn)
    trainer = dd.Trainer(fn, opt, **_pipe(stages))
    state, losses = trainer.fit(batches, params=params, progress=False)
    close(trainer.params(state), want)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)

deep_loss = M.staged_loss          # as many layers as the params have


def test_init_with_another_model_trains_that_model() -> None:
    """A re-run cell: the same Trainer's `init` given a model with more layers (the
    batches' shapes unchanged) trains the new model, as optax does, and gives its
    parameters back in their shape; so does a model whose leaves only change shape."""
    _, batches = setup()
    opt = optax.adam(1e-2)
    trainer = dd.Trainer(deep_loss, opt, microbatches=4, schedule="1f1b")
    for widths in ([6, 8, 4], [6, 8, 8, 4], [6, 5, 7, 4]):
        params = M.init_dense(KEY, widths)
        want, want_losses = reference(params, batches, opt, deep_loss)
        trainer.init(params)
        state, losses = trainer.fit(batches, progress=False)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
        close(trainer.params(state), want)


def test_apply_if_finite_couples_stages_and_is_refused() -> None:
    """`optax.apply_if_finite` skips the whole update when any gradient is not finite:
    applied per stage, a NaN in stage 1's gradients would skip stage 1's update and
    still move stage 0's (the tester's case: optax moved nothing). It is refused like a
    global-norm clip, by its non-finite trial; element-wise optimizers, NaN-safe ones
    included, still pass the check."""
    params, batches = setup()
    guarded = optax.apply_if_finite(optax.sgd(0.1), 3)
    trainer = dd.Trainer(loss_fn, guarded, microbatches=2, schedule="1f1b")
    state = trainer.init(params)
    with pytest.raises(dd.OptimizerError, match=r"(?s)couples.*NaN in one gradient of stage 1"):
        trainer.step(state, *batches[0])
    from dagdiff.train.optimizer import check_per_stage

    leaves = jax.tree_util.tree_leaves(params)
    groups, stages = [(0, 1), (2, 3)], [0, 1]
    for ok in (optax.adam(1e-3), optax.chain(optax.zero_nans(), optax.adam(1e-3)),
               optax.lamb(1e-3), optax.MultiSteps(optax.adam(1e-3), 2)):
        check_per_stage(ok, leaves, groups, stages)
    # what the check guards against, on the stand-ins: optax skips both stages
    g = [jnp.ones_like(x) for x in leaves]
    g[2] = g[2].reshape(-1).at[0].set(jnp.nan).reshape(g[2].shape)
    updates, _ = guarded.update(g, guarded.init(leaves), leaves)
    assert all(not np.any(u) for u in updates)


@dd.layer(name="scaled")
def _scaled(h: Any, s: Any) -> Any:
    return h * s


def _scaled_loss(params: Any, x: Any, t: Any, scale: Any) -> Any:
    with dd.stage(0):
        h = M.dense(params[0], x)
    with dd.stage(1):
        return M.mse(_scaled(M.dense(params[1], h), scale), t)


@pytest.mark.parametrize("how", ["threads", "replicas", "cluster"])
def test_an_argument_left_out_of_batch_argnums_is_read_whole(how: str, request: Any
                                                             ) -> None:
    """`batch_argnums=(1, 2)` leaves the fourth argument (a per-step scale here; a dropout
    key, which dagdiff's own error sends users to) whole for every microbatch and
    replica, as `dd.value_and_grad` does; a Trainer failed with a bare KeyError. Each
    step's new value is used (not the first step's, traced once). Equal to jax + optax."""
    params, batches = setup(3)
    scales = [jnp.linspace(0.5, 1.5, 4) * (1 + i) for i in range(3)]
    client = request.getfixturevalue("client2") if how == "cluster" else None
    trainer = dd.Trainer(_scaled_loss, optax.sgd(0.1), microbatches=2, schedule="1f1b",
                         batch_argnums=(1, 2), client=client,
                         replicas=2 if how == "replicas" else 1)
    state = trainer.init(params)
    losses = []
    for (x, t), scale in zip(batches, scales):
        state, loss = trainer.step(state, x, t, scale)
        losses.append(float(loss.result() if client is not None
                            else np.asarray(dask.compute(loss)[0])))
    want, want_losses = params, []
    for (x, t), scale in zip(batches, scales):
        loss, g = jax.value_and_grad(_scaled_loss)(want, x, t, scale)
        want_losses.append(float(loss))
        want = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, want, g)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    close(trainer.params(state), want)


@pytest.mark.parametrize("per_stage", [False, True])
def test_an_optimizer_state_holding_a_typed_prng_key_trains(per_stage: bool) -> None:
    """`optax.add_noise` keeps a typed PRNG key (``key<fry>``) in its state: a Trainer's
    step failed on it ("Cannot interpret 'key<fry>' as a data type", sizing the state),
    also with ``per_stage_optimizer=True``, which dagdiff's own error for add_noise
    advises. With no noise (eta 0) it equals optax's sgd; inside `MultiSteps` too."""
    params, batches = setup()
    noisy = optax.chain(optax.add_noise(0.0, 0.55, 0), optax.sgd(0.1))
    opts = [noisy, optax.MultiSteps(noisy, 2)] if per_stage else [optax.MultiSteps(
        optax.chain(optax.add_noise(0.0, 0.55, 0), optax.sgd(0.1)), 2)]
    for opt in opts:
        if not per_stage:                 # one stage: nothing to couple
            fn, kw = M.mlp_loss, {}
        else:
            fn, kw = loss_fn, {"microbatches": 2, "schedule": "1f1b",
                               "per_stage_optimizer": True}
        trainer = dd.Trainer(fn, opt, **kw)
        state, losses = trainer.fit(batches, params=params, progress=False)
        want, want_losses = reference(params, batches, opt, fn)
        close(trainer.params(state), want)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


def test_an_optimizer_that_couples_stages_is_refused_unless_asked_per_stage() -> None:
    """Regression: dagdiff applies the optimizer to each stage's parameters on its worker,
    so `optax.clip_by_global_norm` clipped each stage by its own norm and the parameters
    drifted from optax's without a word (sgd + clip: the losses differed by step 2). Such
    an optimizer now fails the first step, naming the leaf and the fix;
    ``per_stage_optimizer=True`` runs it per stage (equal to optax applied to each
    stage's leaves); an element-wise chain (clip + adamw) matches optax on the whole
    model."""
    params, batches = setup()
    coupled = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2))
    trainer = dd.Trainer(loss_fn, coupled, microbatches=2, schedule="1f1b")
    state = trainer.init(params)
    with pytest.raises(dd.OptimizerError,
                       match=r"(?s)stage 0.*leaf 0.*clip_by_global_norm.*per_stage_optimizer"):
        trainer.step(state, *batches[0])

    trainer = dd.Trainer(loss_fn, coupled, microbatches=2, schedule="1f1b",
                         per_stage_optimizer=True)
    state, losses = trainer.fit(batches, params=params, progress=False)
    want, states, want_losses = params, None, []
    for x, t in batches:                  # optax on each stage's list of leaves
        loss, g = jax.value_and_grad(loss_fn)(want, x, t)
        want_losses.append(float(loss))
        stages = [jax.tree_util.tree_leaves(want[s]) for s in range(2)]
        grads = [jax.tree_util.tree_leaves(g[s]) for s in range(2)]
        states = states or [coupled.init(p) for p in stages]
        new = []
        for s in range(2):
            u, states[s] = coupled.update(grads[s], states[s], stages[s])
            new.append(jax.tree_util.tree_unflatten(
                jax.tree_util.tree_structure(want[s]), optax.apply_updates(stages[s], u)))
        want = new
    close(trainer.params(state), want)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    whole, _ = reference(params, batches, coupled)      # what the check guards against
    assert not all(np.allclose(a, b, rtol=1e-5) for a, b in zip(
        jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(whole)))

    fine = optax.chain(optax.clip(0.1), optax.adamw(1e-2))
    trainer = dd.Trainer(loss_fn, fine, microbatches=2, schedule="1f1b")
    state, losses = trainer.fit(batches, params=params, progress=False)
    want, want_losses = reference(params, batches, fine)
    close(trainer.params(state), want)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)

    # the global-norm clip across stages: optax's clip_by_global_norm on the whole model
    trainer = dd.Trainer(loss_fn, optax.adam(1e-2), microbatches=2, schedule="1f1b",
                         clip_global_norm=0.05)
    state, losses = trainer.fit(batches, params=params, progress=False)
    close(trainer.params(state), whole)
    np.testing.assert_allclose(losses, reference(params, batches, coupled)[1], rtol=1e-5)
    with pytest.raises(dd.ArgumentError, match="clip_global_norm must be a number > 0"):
        dd.Trainer(loss_fn, optax.adam(1e-2), clip_global_norm=0)

    # an optimizer keyed on the parameters' tree cannot run on a stage's list of leaves:
    # said before any step runs, with or without per_stage_optimizer
    keyed = optax.multi_transform({"a": optax.adam(1e-2), "s": optax.sgd(0.1)},
                                  [{"w": "a", "b": "s"}, {"w": "a", "b": "s"}])
    for per_stage in (False, True):
        trainer = dd.Trainer(loss_fn, keyed, microbatches=2, schedule="1f1b",
                             per_stage_optimizer=per_stage)
        state = trainer.init(params)
        with pytest.raises(dd.OptimizerError, match="(?s)list of their leaves.*multi_transform"):
            trainer.step(state, *batches[0])

    # an optimizer whose update needs extra arguments (value=): said so, with a fix
    from optax import contrib

    for extra, needs in ((contrib.reduce_on_plateau(), "'value'"),
                         (optax.lbfgs(), "'value', 'grad', 'value_fn'")):
        trainer = dd.Trainer(loss_fn, extra, microbatches=2, schedule="1f1b")
        state = trainer.init(params)
        with pytest.raises(dd.OptimizerError, match=f"(?s)extra argument.*{needs}.*Fix"):
            trainer.step(state, *batches[0])


@pytest.mark.distributed
@pytest.mark.parametrize("replicas,window", [(1, 1), (2, 3)])
def test_clip_global_norm_equals_optax_over_every_stage_on_a_cluster(
        client4: Any, replicas: int, window: int) -> None:
    """`clip_global_norm=c` on a cluster (each stage's sum of squares on its worker,
    the norm on stage 0's, read by every stage's update): the parameters and losses of
    ``optax.chain(optax.clip_by_global_norm(c), optax.sgd)`` on the whole model, with
    the clip active, with replicas (their mean gradients' norm) and in fit windows."""
    params, batches = setup(6)
    opt = optax.sgd(0.5)
    want, want_losses = reference(params, batches,
                                  optax.chain(optax.clip_by_global_norm(0.02), opt))
    unclipped, _ = reference(params, batches, opt)
    trainer = dd.Trainer(loss_fn, opt, microbatches=2, schedule="1f1b", replicas=replicas,
                         client=client4, clip_global_norm=0.02)
    state, losses = trainer.fit(batches, params=params, progress=False, window=window)
    close(trainer.params(state), want)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert not np.allclose(jax.tree_util.tree_leaves(want)[0],
                           jax.tree_util.tree_leaves(unclipped)[0], rtol=1e-3)

@pytest.mark.distributed
@pytest.mark.parametrize("schedule,replicas", [("1f1b", 1), ("gpipe", 1), ("1f1b", 2),
                                               ("gpipe", 2)])
def test_trainer_on_cluster_matches_optax(client4: Any, schedule: str, replicas: int) -> None:
    params, batches = setup()
    opt = optax.adam(1e-2)
    want, want_losses = reference(params, batches, opt)
    trainer = dd.Trainer(loss_fn, opt, microbatches=2, schedule=schedule, replicas=replicas,
                         client=client4)
    state = trainer.init(params, *batches[0])         # placed on the stage workers now
    losses = []
    for x, t in batches:
        state, loss = trainer.step(state, x, t)        # submitted ahead, not awaited
        losses.append(loss)
    assert all(hasattr(x, "result") for x in losses)
    np.testing.assert_allclose([x.result() for x in losses], want_losses, rtol=1e-5)
    close(trainer.params(state), want)
    # fit holds no loss Future of a finished step (a held loss whose worker dies would make
    # Dask run that step's programs again alone): its states keep the number
    fitted, fit_losses = trainer.fit(batches[:2], state=state, progress=False)
    assert isinstance(fitted.loss, float) and fitted.loss == fit_losses[-1]


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["step", "fit"])
def test_a_loader_refilling_one_numpy_buffer_trains_on_each_batch(client2: Any,
                                                                    how: str) -> None:
    """A data loader that fills one NumPy buffer in place for every batch: each step
    trains on the batch it was given (the graph reached the workers after the call, and
    `fit` took a window's batches before building it: every step of a window trained on
    its last batch, losses off by 0.1-0.5)."""
    params, batches = setup(8)
    opt = optax.adam(1e-2)
    want, want_losses = reference(params, batches, opt)

    def loader() -> Any:
        bx = np.empty(np.shape(batches[0][0]), np.float32)
        bt = np.empty(np.shape(batches[0][1]), np.float32)
        for x, t in batches:
            bx[...] = x
            bt[...] = t
            yield bx, bt

    trainer = dd.Trainer(loss_fn, opt, microbatches=2, schedule="1f1b", client=client2)
    state = trainer.init(params)
    if how == "step":
        losses = []
        for x, t in loader():
            state, loss = trainer.step(state, x, t)        # not awaited
            losses.append(loss)
        got = [float(x.result()) for x in losses]
    else:
        state, got = trainer.fit(loader(), window=4, progress=False)
    np.testing.assert_allclose(got, want_losses, rtol=1e-5)
    close(trainer.params(state), want)


@pytest.mark.distributed
def test_params_and_opt_state_stay_on_workers(client2: Any, monkeypatch: Any) -> None:
    params, batches = setup(4)
    trainer = dd.Trainer(loss_fn, optax.sgd(0.1), microbatches=2, schedule="1f1b",
                         client=client2, copy_every=1, copy_interval=0)
    gathered: list[Any] = []
    real = client2._gather        # every gather (Future.result too) goes through it

    def spy(futures: Any, *a: Any, **k: Any) -> Any:
        gathered.extend(f.key for f in jax.tree_util.tree_leaves(futures) if hasattr(f, "key"))
        return real(futures, *a, **k)

    monkeypatch.setattr(client2, "_gather", spy)
    state = trainer.init(params)
    # the losses through Dask's gather, so that the spy sees every value the client reads
    # (with pushes on, a loss comes by push instead: tests/test_inbox.py)
    with dask.config.set({"dagdiff.direct.push-outputs": False}):
        for x, t in batches:
            state, loss = trainer.step(state, x, t)
            float(loss.result())
    assert gathered and all(dd.key_info(k).phase == "loss" for k in gathered), gathered
    # each (replica, stage) state is one Future held on its stage's worker

    client2.gather(list(state.placed.values()))   # wait: the last update may still run
    client2.gather(list(state.backup.values()))
    who = client2.who_has(list(state.placed.values()) + list(state.backup.values()))
    slots = dd.cluster.info.slot_names(client2)
    for (r, g), fut in state.placed.items():
        assert f"slot{g}" in {slots[a] for a in who[fut.key]}
        # recover=True: a copy of each stage's state on the other worker (the copy task's
        # worker may also keep the original as a replica it fetched)
        (copy_at,) = who[state.backup[(r, g)].key]
        assert slots[copy_at] == f"slot{1 - g}"
    # without recovery, each state is one value on its stage's worker and nowhere else
    plain = dd.Trainer(loss_fn, optax.sgd(0.1), microbatches=2, schedule="1f1b",
                       client=client2, recover=False)
    state = plain.init(params)
    for x, t in batches:
        state, loss = plain.step(state, x, t)
    loss.result()
    client2.gather(list(state.placed.values()))
    assert state.backup is None
    who = client2.who_has(list(state.placed.values()))
    for (r, g), fut in state.placed.items():
        (addr,) = who[fut.key]
        assert slots[addr] == f"slot{g}"


def test_copies_wait_for_both_copy_every_steps_and_copy_interval_seconds(
        monkeypatch: Any) -> None:
    """With one replica a copy of the state goes out once `copy_every` steps and
    `copy_interval` seconds have passed since the newest one (a fake clock); steps run
    again from an older state count from there."""
    from types import SimpleNamespace

    import dagdiff.train.restoring as restoring

    now = [100.0]
    monkeypatch.setattr(restoring.time, "monotonic", lambda: now[0])
    trainer = dd.Trainer(loss_fn, optax.sgd(0.1), copy_every=3, copy_interval=2.0)
    model = SimpleNamespace(groups=[0, 1])
    sent = []
    for step in range(1, 13):
        if trainer._to_copy(model, None, step):   # type: ignore[arg-type]
            sent.append(step)
        now[0] += 0.5                             # 0.5 s per step: 2 s is 4 steps
    assert sent == [3, 7, 11]
    assert trainer._to_copy(model, None, 5) == []         # a recovery went back to 5
    now[0] += 1.0                                         # 2 s after the copy at 11
    assert trainer._to_copy(model, None, 7) == []
    assert trainer._to_copy(model, None, 8) == [(0, 0), (0, 1)]
    every = dd.Trainer(loss_fn, optax.sgd(0.1), copy_every=2, copy_interval=0)
    assert [s for s in range(1, 8) if every._to_copy(model, None, s)] == [2, 4, 6]
    with pytest.raises(dd.ArgumentError, match="copy_interval"):
        dd.Trainer(loss_fn, optax.sgd(0.1), copy_interval=-1)
    # by default the interval follows the state's size: adam keeps two moments per
    # parameter and a step count (int32): 3 x (512 x 512 + 512) float32 + 4 bytes
    auto = dd.Trainer(loss_fn, optax.adam(1e-3))
    auto.init({"w": jnp.zeros((512, 512)), "b": jnp.zeros(512)})
    size = 3 * (512 * 512 + 512) * 4 + 4
    assert auto.copy_seconds() == pytest.approx(
        restoring.COPY_SHARE * size / restoring.COPY_RATE)


@pytest.mark.distributed
def test_copies_go_to_a_worker_that_runs_no_stage(client4: Any) -> None:
    """Two stages on a 4-worker cluster: each stage's copy goes to slot2, the first slot
    after its own that runs no stage (where a lost stage is re-placed), not to the other
    stage's worker, whose hops it would slow."""
    params, batches = setup(2)
    trainer = dd.Trainer(loss_fn, optax.sgd(0.1), microbatches=2, schedule="1f1b",
                         client=client4, copy_every=1, copy_interval=0)
    state = trainer.init(params)
    for x, t in batches:
        state, loss = trainer.step(state, x, t)
    loss.result()
    client4.gather(list(state.backup.values()))
    slots = dd.cluster.info.slot_names(client4)
    who = client4.who_has(list(state.placed.values()) + list(state.backup.values()))
    for (r, g), fut in state.placed.items():
        assert {slots[a] for a in who[fut.key]} >= {f"slot{g}"}
        assert {slots[a] for a in who[state.backup[(r, g)].key]} == {"slot2"}
    del state, loss


def test_checkpoint_round_trip_and_exact_resume(tmp_path: Any) -> None:
    params, batches = setup(6)
    opt = optax.adam(1e-2)
    trainer = dd.Trainer(loss_fn, opt, microbatches=2, schedule="gpipe")
    full, _ = trainer.fit(batches, params=params, progress=False)
    t2 = dd.Trainer(loss_fn, opt, microbatches=2, schedule="gpipe")
    half, _ = t2.fit(batches[:3], params=params, progress=False)
    dd.save(str(tmp_path / "ckpt"), half)             # the state knows its trainer
    restored = dd.load(str(tmp_path / "ckpt"))
    assert restored.step == 3
    close(restored.params, jax.tree_util.tree_leaves(t2.params(half)), rtol=0)
    t3 = dd.Trainer(loss_fn, opt, microbatches=2, schedule="gpipe")
    with pytest.raises(dd.TrainerError, match=r"(?s)trainer.init.*trainer.fit.*dd.load"):
        t3.fit(batches[3:], state=restored, progress=False)     # no structure yet
    t3.init(params)                                   # the model's structure
    resumed, _ = t3.fit(batches[3:], state=restored, progress=False)
    assert resumed.step == 6
    close(t3.params(resumed), trainer.params(full), rtol=0)
    # a checkpoint of another model's shapes, or saved with another optimizer, says so
    # (the first trained the checkpoint's shapes silently, the second raised a pytree error)
    t4 = dd.Trainer(loss_fn, opt, microbatches=2, schedule="gpipe")
    t4.init(M.init_dense(KEY, [6, 12, 4]))            # a wider hidden layer
    with pytest.raises(dd.CheckpointError, match=r"parameter leaf \d is float32\[.*where "
                                                 r"the model's is float32"):
        t4.fit(batches[3:], state=dd.load(str(tmp_path / "ckpt")), progress=False)
    t5 = dd.Trainer(loss_fn, optax.sgd(1e-2), microbatches=2, schedule="gpipe")
    t5.init(params)
    with pytest.raises(dd.CheckpointError, match="saved with another optimizer"):
        t5.fit(batches[3:], state=dd.load(str(tmp_path / "ckpt")), progress=False)


def test_a_state_of_an_earlier_init_of_another_model_says_so() -> None:
    """A notebook cell re-run with a changed model: `init` again, then the first init's
    state stepped or read raises a CheckpointError (an IndexError or a shape error of the
    new model's parameters before); the new state trains as optax does."""
    params, batches = setup(2)
    wide = M.init_dense(KEY, [6, 12, 4])
    opt = optax.sgd(0.1)
    trainer = dd.Trainer(loss_fn, opt, microbatches=2, schedule="1f1b")
    old = trainer.init(params)
    old, _ = trainer.step(old, *batches[0])
    new = trainer.init(wide)
    for use in (lambda: trainer.step(old, *batches[1]), lambda: trainer.params(old),
                lambda: trainer.fit(batches, state=old, progress=False)):
        with pytest.raises(dd.CheckpointError, match="made for another model"):
            use()
    new, loss = trainer.step(new, *batches[1])
    want, want_losses = reference(wide, batches[1:], opt)
    np.testing.assert_allclose(float(loss), want_losses[0], rtol=1e-5)
    close(trainer.params(new), want)


@pytest.mark.slow
def test_multimodal_grads_equal_jax_grad() -> None:
    import dask

    from dagdiff.examples import multimodal as mm

    params = mm.init_params(KEY)
    tokens, images = mm.make_batch(KEY)
    loss, grads = dd.value_and_grad(mm.clip_loss_fn)(params, tokens, images)
    stages = {dd.key_info(k).stage for k in loss.__dask_graph__() if dd.key_info(k).phase == "F"}
    assert stages == {0, 1, 2}
    got_l, got_g = dask.compute(loss, grads, scheduler="threads")
    want_l, want_g = jax.value_and_grad(mm.clip_loss_fn)(params, tokens, images)
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5)
    close(got_g, want_g)


@pytest.mark.slow
@pytest.mark.distributed
def test_multimodal_data_parallel_training(client4: Any) -> None:
    """Two data-parallel groups (text worker + two vision workers each, 6 stage slots on 4
    workers) with gradient all-reduce equal one process training on the mean of the
    groups' losses."""
    from dagdiff.examples import multimodal as mm

    params = mm.init_params(KEY)
    batches = [mm.make_batch(jax.random.fold_in(KEY, i), n=16) for i in range(2)]
    opt = optax.adam(1e-2)

    def two_group_loss(p: Any, tokens: Any, images: Any) -> Any:
        return (mm.clip_loss_fn(p, tokens[:8], images[:8]) +
                mm.clip_loss_fn(p, tokens[8:], images[8:])) / 2

    p, s = params, opt.init(params)
    for tok, img in batches:
        g = jax.grad(two_group_loss)(p, tok, img)
        u, s = opt.update(g, s, p)
        p = optax.apply_updates(p, u)
    trainer = dd.Trainer(mm.clip_loss_fn, opt, replicas=2, client=client4)
    state = trainer.init(params)
    for tok, img in batches:
        state, loss = trainer.step(state, tok, img)
    close(trainer.params(state), p, rtol=1e-4)


@pytest.mark.slow
def test_main_command_runs(tmp_path: Any) -> None:
    import subprocess
    import sys

    png = tmp_path / "step.png"
    out = subprocess.run(
        [sys.executable, "-m", "dagdiff", "demo", "--steps", "4", "--no-progress",
         "--dashboard", "", "--timeline", str(png)],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "test accuracy" in out.stdout and png.exists()
    bad = subprocess.run([sys.executable, "-m", "dagdiff", "demo", "--batch", "100"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "multiple of" in bad.stderr
    assert "Traceback" not in bad.stderr


def _running_keys(dask_worker: Any) -> dict[str, str]:
    return dict(dask_worker.extensions["dagdiff"]._running)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("window", [1, 2])
def test_ctrl_c_in_fit_keeps_the_last_finished_state_and_the_cluster(client2: Any,
                                                                     window: int) -> None:
    """A KeyboardInterrupt in the middle of fit (here from the batch iterator, as a
    Ctrl-C between steps): no program keeps running, the trainer's latest state is the
    last finished step's (equal to plain optax over those steps), and fit goes on. With
    steps submitted two at a time (`window=2`) that state is a window's last."""
    import time
    import warnings

    params, batches = setup(8)
    opt = optax.adam(1e-2)
    tr = dd.Trainer(loss_fn, opt, microbatches=4, schedule="1f1b", client=client2)
    tr.init(params)

    def interrupted() -> Any:
        for i, b in enumerate(batches):
            if i == 5:
                raise KeyboardInterrupt
            yield b

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyboardInterrupt):
            tr.fit(interrupted(), progress=False, window=window)
    assert any("interrupted after" in str(w.message) for w in caught)
    # released programs stop (one the worker had just been sent may start first: it
    # stops as it begins), so the workers soon run none
    deadline = time.time() + 20
    left = client2.run(_running_keys)
    while any(left.values()) and time.time() < deadline:
        time.sleep(0.1)
        left = client2.run(_running_keys)
    assert not any(left.values()), left
    done = tr._last
    if window == 1:
        assert done is not None and 3 <= done.step <= 5       # 2 steps were in flight
    else:                                   # 2 windows of 2 were in flight: none may end
        assert done is not None and done.step in (0, 2, 4), done
    want, _ = reference(params, batches[:done.step], opt)
    close(tr.params(done), want)
    state, losses = tr.fit(batches[done.step:], progress=False)   # goes on from there
    want, want_losses = reference(params, batches, opt)
    close(tr.params(state), want)
    np.testing.assert_allclose(losses, want_losses[done.step:], rtol=1e-5)


def test_an_optimizer_travels_as_bytes_made_once() -> None:
    """optax transforms are closures plain pickle refuses: the Trainer's optimizer pickles
    as cloudpickled bytes made once, so a step's whole graph pickles with plain pickle (no
    cloudpickle fallback: 3.1 -> 0.4 ms per step), and unpickles to one object per
    process."""
    import pickle

    from dagdiff.train.optimizer import ScaledOptimizer

    opt = ScaledOptimizer(optax.adam(1e-2), 2, "t-r2")
    with pytest.raises(Exception):
        pickle.dumps(opt.optimizer)                       # what it protects against
    graph = {"update": ("update_task", opt), "other": ("update_task", opt)}
    first, second = pickle.loads(pickle.dumps(graph)), pickle.loads(pickle.dumps(graph))
    assert first["update"][1] is second["other"][1]        # revived once per process
    params = [jnp.ones(3)]
    grads = [jnp.full(3, 4.0)]
    state = opt.optimizer.init(params)
    want = opt.step(params, state, grads)
    got = first["update"][1].step(params, state, grads)
    close(got, want)


@pytest.mark.distributed
def test_a_trainer_steps_graph_pickles_with_plain_pickle(client2: Any) -> None:
    import pickle

    params, batches = setup(3)
    trainer = dd.Trainer(loss_fn, optax.adam(1e-2), microbatches=2, schedule="1f1b",
                         client=client2)
    graphs = []
    build = trainer._step_graph

    def spy(*a: Any, **k: Any) -> Any:
        graphs.append(build(*a, **k))
        return graphs[-1]

    trainer._step_graph = spy                 # type: ignore[method-assign]
    trainer.fit(batches, params=params, progress=False)
    assert len(graphs) == 3                   # the lowered step, then two bound ones
    for graph, _, _ in graphs:
        pickle.dumps(dict(graph), protocol=5)


def test_the_client_heap_is_frozen_after_the_first_and_sixteenth_step(monkeypatch: Any) -> None:
    """`build.heap.freeze_heap`: steps built for a cluster collect and `gc.freeze()` the
    client's heap after the first and the 16th (then never again); not without a
    cluster, nor with dask config ``dagdiff.freeze-heap: false``."""
    import dask

    from dagdiff.build import heap

    calls: list[str] = []
    monkeypatch.setattr(heap.gc, "collect", lambda *a: calls.append("collect"))
    monkeypatch.setattr(heap.gc, "freeze", lambda: calls.append(f"freeze@{heap._built}"))
    monkeypatch.setattr(heap, "_built", 0)
    monkeypatch.setattr(heap, "_FROZEN", False)
    assert not heap.freeze_heap(None)                  # the local scheduler: no cluster
    with dask.config.set({"dagdiff.freeze-heap": False}):
        assert not any(heap.freeze_heap(object()) for _ in range(20))
    assert calls == [] and not heap.heap_frozen()
    froze = [i + 1 for i in range(40) if heap.freeze_heap(object())]
    assert froze == [1, 16] and heap.heap_frozen()
    assert calls == ["collect", "freeze@1", "collect", "freeze@16"]


@pytest.mark.distributed
def test_a_state_of_a_closed_client_says_so(client2: Any) -> None:
    """A state made through a Client that was closed since (its values went with it),
    given to a Trainer on another client: a LostStateError that says the client was
    closed and how to go on, not that a worker was lost."""
    from distributed import Client

    params, batches = setup()
    other = Client(client2.scheduler.address, set_as_default=False)
    try:
        tr = dd.Trainer(loss_fn, optax.sgd(0.1), microbatches=2, schedule="1f1b",
                        client=other)
        state, loss = tr.step(tr.init(params), *batches[0])
        loss.result(timeout=60)
    finally:
        other.close()
    fresh = dd.Trainer(loss_fn, optax.sgd(0.1), microbatches=2, schedule="1f1b",
                       client=client2)
    fresh.init(params)
    with pytest.raises(dd.LostStateError, match=r"(?s)Client that is closed.*no worker"):
        fresh.step(state, *batches[1])
    state, losses = fresh.fit(batches, progress=False)        # from its own init
    assert len(losses) == len(batches)


@pytest.mark.distributed
def test_a_fit_stopped_by_a_bad_batch_keeps_every_step_before_it(client2: Any) -> None:
    """A last batch that does not split into the microbatches (a data loader without
    drop_last), in the same window as a good one: the good batches all run, the error
    says how many and where to go on, and `fit` without state= continues from the last
    finished step (it started over from the fit's first state before: every step of a
    long fit lost); the parameters equal optax's over the good batches."""
    params, batches = setup(6)
    x, t = batches[-1]
    trainer = dd.Trainer(loss_fn, optax.adam(1e-2), microbatches=4, schedule="1f1b",
                         client=client2)
    with pytest.raises(dd.MicrobatchError, match="does not divide into 4") as err:
        trainer.fit(batches[:5] + [(x[:10], t[:10])], params=params, progress=False,
                    window=2)
    assert any("stopped after 5 finished step(s)" in n and "from step 5" in n
               for n in getattr(err.value, "__notes__", ())), err.value
    state, losses = trainer.fit([batches[5]], progress=False)
    assert state.step == 6 and len(losses) == 1
    want, want_losses = reference(params, batches, optax.adam(1e-2))
    close(trainer.params(state), want)
    np.testing.assert_allclose(losses, want_losses[5:], rtol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["scheduler", "replicas"])
def test_fit_windows_fall_back_to_one_step_at_a_time(client2: Any, kind: str) -> None:
    """`fit(window=3)` where steps cannot share a window (scheduler dispatch: each step
    is submitted alone), and with two replicas on two workers (each runs a stage of
    each replica): the losses and parameters equal plain optax's."""
    params, batches = setup(5)
    opt = optax.adam(1e-2)
    kw = ({"dispatch": "scheduler"} if kind == "scheduler" else {"replicas": 2})
    tr = dd.Trainer(loss_fn, opt, microbatches=2, schedule="1f1b", client=client2, **kw)
    state, losses = tr.fit(batches, params=params, progress=False, window=3)
    want, want_losses = reference(params, batches, opt)
    close(tr.params(state), want, rtol=1e-5)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("window", [1, 2])
def test_ctrl_c_while_fit_waits_for_a_step_stops_every_program(client2: Any, window: int,
                                                               monkeypatch: Any) -> None:
    """A KeyboardInterrupt while fit waits for a step's loss (here from the wait itself),
    its traceback kept as a notebook keeps it: no program keeps running, and the
    trainer's latest state (a window's last, with `window=2`) equals plain optax over its
    steps."""
    import time
    import warnings

    from dagdiff.train.fit import FitRun

    params, batches = setup(8)
    opt = optax.adam(1e-2)
    tr = dd.Trainer(loss_fn, opt, microbatches=4, schedule="1f1b", client=client2)
    tr.init(params)
    real, calls = FitRun.take_one, [0]

    def take_one(self: Any) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        real(self)

    monkeypatch.setattr(FitRun, "take_one", take_one)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(KeyboardInterrupt) as info:   # kept, as a notebook keeps it
            tr.fit(batches, progress=False, window=window)
    monkeypatch.setattr(FitRun, "take_one", real)
    deadline = time.time() + 20
    left = client2.run(_running_keys)
    while any(left.values()) and time.time() < deadline:
        time.sleep(0.1)
        left = client2.run(_running_keys)
    assert not any(left.values()), (left, info.tb)
    done = tr._last
    want, _ = reference(params, batches[:done.step], opt)
    close(tr.params(done), want)
