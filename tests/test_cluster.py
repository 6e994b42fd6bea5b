"""dd.local_cluster's worker environment: glibc's top pad reaches every worker process,
also after a restart (XLA's CPU kernels ran 2x slower without it)."""
from __future__ import annotations

import os

import pytest

import dagdiff as dd
from dagdiff.cluster import WORKER_MALLOC_ENV


def _env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("MALLOC_TOP_PAD_", "MALLOC_TRIM_THRESHOLD_",
                                           "XLA_FLAGS", "OMP_NUM_THREADS")}


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_workers_start_with_the_top_pad_and_keep_it_after_a_restart() -> None:
    from distributed import Client

    cluster = dd.local_cluster(n_workers=1, dashboard_address=None, quiet=True)
    client = Client(cluster, set_as_default=False)
    try:
        (env,) = client.run(_env).values()
        assert env["MALLOC_TOP_PAD_"] == WORKER_MALLOC_ENV["MALLOC_TOP_PAD_"]
        assert env["OMP_NUM_THREADS"] == "1"
        assert not (env["XLA_FLAGS"] or "").count("intra_op_parallelism_threads")
        (addr,) = client.scheduler_info()["workers"]
        client.restart_workers([addr])
        client.wait_for_workers(1, timeout=60)
        (env,) = client.run(_env).values()
        assert env["MALLOC_TOP_PAD_"] == WORKER_MALLOC_ENV["MALLOC_TOP_PAD_"]
        assert list(dd.cluster.slot_names(client).values()) == ["slot0"]
    finally:
        client.close()
        cluster.close()
