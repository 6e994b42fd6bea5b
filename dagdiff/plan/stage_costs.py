"""What a `Profile` holds per stage (`StageProfile`: measured times, bytes and memory) and
per layer call (`LayerCost`), and how profiles and predictions show numbers (tables,
bytes, hosts)."""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Sequence

from distributed.comm.addressing import get_address_host


__all__ = ["StageProfile", "LayerCost", "html_table", "fmt_bytes", "host_of"]


@dataclass(frozen=True)
class StageProfile:
    """One global stage, measured: seconds per microbatch of each action kind (medians
    over the microbatches; a program's split/accumulate/loss tasks are counted with the
    action they belong to), and bytes per microbatch.

    ``i`` is 0 where the stage computes no input gradient (stage 0 of a model whose
    input is data); ``b`` and ``i``/``w`` come from the full- and split-backward
    schedules the profile ran (when only one kind ran: I = W = B / 2, or B = I + W).
    ``send_forward``: activation bytes it sends to later stages; ``send_backward``:
    cotangent bytes it sends to earlier stages; ``activation_bytes``: what one live
    microbatch keeps on its worker (the inputs and outputs of the stage's layer calls
    before fusion, parameters left out: an estimate from the traced avals);
    ``param_bytes``: its parameters. ``kept``: per recomputation policy, the bytes one
    live microbatch keeps from its forward to its backward (residuals read off the
    fused stage's VJP, `dagdiff.core.footprint`), what `dd.predict(...).memory` adds up;
    ``recompute``: per policy, the share of F its backward runs again (1 for "full",
    XLA's cost estimate for "selective"); ``peak_memory``: the most bytes its worker
    held in the profiled steps (measured, `Recording.peak_memory`); ``stash``: per
    policy, what a split backward's I leaves for its W per microbatch; ``fused_stash``:
    per policy, what the loss's forward run with its I carries to its W (None: its
    backward does not split); ``input_bytes``: one microbatch of the batch inputs it
    reads (the step holds the whole batch); ``received_bytes``: the activations a
    microbatch brings from earlier stages; ``returned_bytes``: the cotangents of those
    its backward sends back (`dagdiff.core.footprint`)."""

    stage: int
    worker: str
    f: float
    b: float
    i: float
    w: float
    send_forward: int
    send_backward: int
    activation_bytes: int
    param_bytes: int
    layers: tuple[str, ...]
    samples: int
    kept: tuple[tuple[str, int], ...] = ()
    recompute: tuple[tuple[str, float], ...] = ()
    peak_memory: int = 0
    stash: tuple[tuple[str, int], ...] = ()
    input_bytes: int = 0
    received_bytes: int = 0
    returned_bytes: int = 0
    fused_stash: tuple[tuple[str, int | None], ...] = ()

    def cost(self, kind: str, policy: str = "none") -> float:
        """Seconds of one action of `kind` (F, B, I or W), the backward's (B, I) with
        the forward work `policy` runs again."""
        base = {"F": self.f, "B": self.b, "I": self.i, "W": self.w}[kind]
        if kind in ("B", "I") and policy != "none":
            base += self.f * self.recompute_share(policy)
        return base

    def recompute_share(self, policy: str) -> float:
        """The share of F that `policy` runs again in the backward."""
        if policy == "none":
            return 0.0
        return dict(self.recompute).get(policy, 1.0 if policy == "full" else 0.0)

    def stash_by(self, policy: str) -> int:
        """Bytes a split backward's I leaves for its W under `policy`."""
        return dict(self.stash).get(policy, 0)

    def fused_stash_by(self, policy: str) -> int | None:
        """What the loss's fused forward carries to its W under `policy` (None: every
        gradient is computed with the forward)."""
        return dict(self.fused_stash).get(policy)

    def kept_by(self, policy: str) -> int:
        """Bytes one live microbatch keeps under `policy` (the traced activations when
        the profile has no residual figures)."""
        return dict(self.kept).get(policy, self.activation_bytes)


@dataclass(frozen=True)
class LayerCost:
    """One layer call of the profiled model (trace order): its stage, XLA's cost estimate
    and the measured seconds per microbatch (forward + backward) it is given: its
    stage's measured time shared out in proportion to the estimates."""

    name: str
    stage: int
    seconds: float
    estimate: float


def html_table(title: str, head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A titled HTML table (what a Profile or Prediction shows in Jupyter)."""
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(x)}</td>" for x in r) + "</tr>"
                   for r in rows)
    return (f"<p>{html.escape(title)}</p><table><thead><tr>{cells}</tr></thead>"
            f"<tbody>{body}</tbody></table>")


def host_of(address: str) -> str:
    """The host part of a worker address (the address itself where it has none)."""
    try:
        return str(get_address_host(address))
    except (ValueError, TypeError):
        return address


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
