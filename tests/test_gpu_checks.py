"""The prepared GPU check script (`benchmarks/gpu_checks.py`) runs end to end here, on CPU,
so the session lent a GPU machine can run it at once: its cluster section's step equals
`jax.value_and_grad`, a value crosses between two workers' programs, and it writes its
report."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_gpu_check_script_runs_and_reports(tmp_path: Any) -> None:
    r = subprocess.run([sys.executable, "benchmarks/gpu_checks.py", "--only", "env",
                        "cluster", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert (tmp_path / "gpu_checks.log").stat().st_size > 0
    assert "failed" not in got["env"] and "failed" not in got["cluster"], got
    assert got["env"]["jax devices"]
    step = got["cluster"]["1f1b step vs jax.value_and_grad"]
    assert step["max grad error"] < 1e-5
    assert step["loss"][0] == pytest.approx(step["loss"][1], rel=1e-5)
    assert got["cluster"]["a device array between workers"]["received"].endswith(
        "value right")
    assert len(got["cluster"]["workers"]) == 2
    zero = got["cluster"]["zero-time stages"]
    assert zero["Trainer.step median ms"] > 0 and zero["fit ms a step (256 steps)"] > 0
