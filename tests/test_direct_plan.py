"""Direct dispatch, the pure part: a worker's order from a simulated run, the programs' plan
(who sends what), program results on the wire, and schedules that cannot run."""
from __future__ import annotations

import pickle
from typing import Any

import dask.sizeof
import numpy as np
import pytest

import dagdiff as dd
from dagdiff.runtime.direct import linearize
from dagdiff.schedules import Action
from tests.models import data, make_loss


# --- the worker order (pure) ------------------------------------------------------------

def test_linearize_keeps_schedule_order_and_places_small_tasks_when_ready() -> None:
    # two workers, two microbatches: F/B actions with schedule priorities, plus a split
    # task (no inputs), a loss select and accumulators without priorities
    deps = {
        "split0": [], "split1": [],
        "F00": ["split0"], "F01": ["split1"], "F10": ["F00"], "F11": ["F01"],
        "loss0": ["F10"], "loss1": ["F11"],
        "B10": ["F10"], "B11": ["F11"], "B00": ["B10", "F00"], "B01": ["B11", "F01"],
        "acc0": ["B00"], "acc1": ["B01", "acc0"],
    }
    worker = {k: ("w1" if k[1:2] == "1" and k[0] in "FB" or k.startswith("loss") else "w0")
              for k in deps}
    # 1F1B on 2 workers, 2 microbatches: w0 F0 F1 B0 B1, w1 F0 B0 F1 B1
    prio = {"F00": 4, "F01": 3, "B00": 2, "B01": 1, "F10": 4, "B10": 3, "F11": 2, "B11": 1}
    order = linearize(deps, worker, prio)
    assert [k for k in order["w0"] if k in prio] == ["F00", "F01", "B00", "B01"]
    assert [k for k in order["w1"] if k in prio] == ["F10", "B10", "F11", "B11"]
    # no inputs: right before the first task that needs them
    assert order["w0"][:4] == ["split0", "F00", "split1", "F01"]
    assert order["w1"] == ["F10", "loss0", "B10", "F11", "loss1", "B11"]
    w0 = order["w0"]
    assert w0.index("acc0") == w0.index("B00") + 1             # right after its input
    assert w0.index("acc1") == w0.index("B01") + 1


def test_linearize_rejects_an_order_that_would_deadlock() -> None:
    deps = {"F0": [], "F1": ["F0"], "B1": ["F1"], "B0": ["B1", "F0"]}
    worker = {"F0": "w0", "B0": "w0", "F1": "w1", "B1": "w1"}
    # w0 wants its backward before its forward: B0 needs B1 needs F1 needs F0
    with pytest.raises(dd.DirectDispatchError, match="cannot run") as e:
        linearize(deps, worker, {"B0": 2, "F0": 1, "F1": 2, "B1": 1})
    assert "w0 at B0" in str(e.value)


def test_plan_programs_is_pure_and_sends_only_what_is_read() -> None:
    """The planning module takes plain dicts (no Dask): two workers, one microbatch."""
    from dagdiff.runtime.direct.plan import Consumers, plan_programs

    deps = {"x": [], "F0": ["x"], "F1": ["F0"], "B1": ["F1"], "B0": ["B1", "F0"],
            "acc0": ["B0"], "loss": ["F1"]}
    where = {"F0": "w0", "B0": "w0", "acc0": "w0", "F1": "w1", "B1": "w1", "x": None,
             "loss": "w1"}
    reads = {"B0": {"B1": frozenset({0}), "F0": None}, "F1": {"F0": None},
             "B1": {"F1": None}, "acc0": {"B0": None}}
    plan = plan_programs(deps, set(deps) - {"x"}, where, {"F0": 2, "B0": 1, "F1": 2, "B1": 1},
                         keep={"loss"}, outputs={"acc0"}, reads=reads)
    w0, w1 = plan.programs
    assert [a.key for a in w0.actions] == ["F0", "B0", "acc0"]
    assert [a.key for a in w1.actions] == ["F1", "B1"]
    assert w0.statics == ("x",)
    b1 = w1.actions[1]
    assert b1.remote == (Consumers("w0", 1, frozenset({0})),)   # one leaf travels
    assert w1.actions[0].export                                  # read by the loss task
    assert w0.actions[2].export and not w0.actions[0].export
    assert plan.direct == frozenset({"F0", "B0", "acc0", "F1", "B1"})


def test_a_program_result_is_a_stub_on_the_wire_and_whole_on_disk() -> None:
    """Another worker's output depends on a program's result for order alone: over a
    comm (a recipient in the context) no values travel; spilled, it keeps them."""
    import asyncio

    from distributed.comm.utils import from_frames, to_frames
    from distributed.protocol import deserialize_bytes, serialize_bytelist, to_serialize

    from dagdiff.runtime.direct.results import ProgramResult
    from dagdiff.runtime.serialize import register

    register()
    value = np.arange(1 << 16, dtype=np.float32)
    result = ProgramResult("prog_slot0-n0-abc", {"acc-x": value, "loss-y": 1.5})
    assert dask.sizeof.sizeof(result) >= value.nbytes

    async def wire(context: Any) -> Any:
        frames = await to_frames({"data": to_serialize(result)}, context=context)
        return sum(len(memoryview(f)) for f in frames), (await from_frames(frames))["data"]

    nbytes, stub = asyncio.run(wire({"sender": {}, "recipient": {"address": "tcp://w1"}}))
    assert stub.stub and stub.program == result.program and nbytes < 2000
    with pytest.raises(dd.DirectDispatchError, match="stays on the worker of prog_slot0"):
        stub.value("acc-x")
    for back in (deserialize_bytes(b"".join(map(bytes, serialize_bytelist(result)))),
                 asyncio.run(wire(None))[1], pickle.loads(pickle.dumps(result))):
        assert not back.stub and back.value("loss-y") == 1.5
        np.testing.assert_array_equal(back.value("acc-x"), value)
    with pytest.raises(dd.DirectDispatchError, match="exported no value nope"):
        result.value("nope")


def test_the_planning_modules_import_nothing_from_dask_or_jax() -> None:
    import ast
    import pathlib

    import dagdiff

    root = pathlib.Path(dagdiff.__file__).parent
    for rel in ("runtime/direct/plan.py", "core/dag.py", "errors.py"):
        tree = ast.parse((root / rel).read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                  and n.level == 0}
        assert not {m.split(".")[0] for m in names} & {"dask", "distributed", "jax"}, rel


class BackwardFirst(dd.Schedule):
    """A broken user schedule: the last stage lists its backwards before its forwards."""

    name = "backward-first"

    def orders(self, num_stages: int, microbatches: int) -> list[list[Action]]:
        f = [Action("F", i) for i in range(microbatches)]
        b = [Action("B", i) for i in range(microbatches)]
        return [f + b for _ in range(num_stages - 1)] + [b + f]


@pytest.mark.distributed
def test_a_schedule_that_cannot_run_fails_when_building(client2: Any) -> None:
    loss_fn = make_loss(2)
    params, x, t = data(2)
    with client2.as_current():
        with pytest.raises(dd.ScheduleError, match="deadlock") as e:
            dd.value_and_grad(loss_fn, microbatches=2, schedule=BackwardFirst())(params, x, t)
    assert "worker 1 at B0" in str(e.value)

