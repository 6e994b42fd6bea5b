"""Direct dispatch: each worker runs its part of a pipeline step as one Dask task (its
*program*), in schedule order, and sends activations and cotangents straight to the
worker that consumes them over distributed's own comms, so no action waits for the
scheduler.

On distributed every dependent hop costs a scheduler round trip plus a transfer (5-10 ms
measured on a small machine), as long as a pipeline action itself, and every task some
bookkeeping. Here a step is a handful of Dask tasks per worker:

* `plan` (pure): which tasks each worker's program runs, in the order of a simulated run
  of the schedule, and which values go to which other worker (only the leaves it reads);
* `graph`: the rewritten Dask graph: a program task per worker carrying the step's run id
  (a `RunNonce`, stamped afresh by dagdiff's scheduler plugin per submission, so a step
  computed again is a new run), the step's outputs as ordinary tasks that wait for every
  program;
* `program`: the frozen record of a worker's program (the plan's actions bound to their
  tasks, the step's inputs, its peers);
* `run`: one run of a program on a worker (`ProgramRun`): its inbox, the interpreter,
  waits with probes of a silent producer, the outbox and the closing exchange;
* `runtime`: the worker extension that routes messages to runs by run id, runs programs
  and answers other workers' and the scheduler's calls (a run's status, a lost peer);
* `results`: what a program task returns (the values the outputs read in place; an empty
  stub when sent to another worker, whose outputs wait on it for order alone), and
  `LocalImport`, a Trainer step's state taken from the previous step's program on the same
  worker (`graph.chain_step`) instead of through a Dask dependency;
* `transport` + `messages`: ordered typed messages between workers over
  `distributed.comm` (the cluster's TLS, comm backend and serializers apply);
* `lanes`: on tcp and tls, the comm's socket handed to threads of the two workers (a
  program writes its small values itself, a reader thread hands them to the waiting
  program): no event loop between two programs.
"""
from __future__ import annotations

from ...errors import DirectDispatchError, UpstreamError
from .graph import RESOURCE_SHARE, DirectGraph, Source, chain_step, next_base, rewrite
from .plan import Consumers, PlannedAction, linearize, plan_programs
from .program import Program
from .runtime import (EXTENSION, DirectRuntime, RunNonce, compute_log, install, new_nonce,
                      run_program)


__all__ = ["DirectDispatchError", "UpstreamError", "RESOURCE_SHARE", "DirectGraph", "next_base",
           "rewrite", "Source", "chain_step", "linearize", "plan_programs", "EXTENSION",
           "PlannedAction", "Consumers",
           "DirectRuntime", "Program", "compute_log", "install", "run_program", "RunNonce",
           "new_nonce"]
