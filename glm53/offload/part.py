"""The hook protocol of the offload layer's parts: the expert cache, prefetch and the CPU tier (a disk tier's decode
side would be one more). ``runtime.Offload`` calls its parts in a loop; a part overrides only the hooks it needs and
the others are never called (``implementing``), so a hook nobody needs costs the decode step nothing.

A decode step, as the engine runs it (every hook on the thread feeding the GPU; the per-layer ones on the compute
stream, with no host synchronisation)::

    before_step()                     the engine is about to launch a step (its forwards)
      forward_start()                 each forward, before the tables change hands (staging, the elastic loan)
      decode_start(rows)              a decode forward, once the tables are the decode's again
        routed(row, selected, weights, z)   each MoE layer of a decode forward, after its routing
        routed_sum(row, routed_sum)         ... on its fp32 routed sum, before it is rounded (changed in place)
        after_layer(row)                    ... once its experts are launched (every forward)
    after_step()                      after the step's synchronisation (host work between two steps)

and ``stats()`` (its entry in ``/stats``, under ``name``) and ``close()``. A part need not subclass :class:`Part` (the
CPU tier cannot import this layer): it has ``name``, ``stats`` and ``close`` and defines the hooks it implements.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

HOOKS = ("before_step", "forward_start", "decode_start", "routed", "routed_sum", "after_layer", "after_step")


class Part:
    """One optional part of the offload layer; every hook does nothing unless a part overrides it."""

    name = "part"  # its key in /stats

    def before_step(self) -> None:
        """Before the engine launches a step."""

    def forward_start(self) -> None:
        """Before each forward of the model, before staging or the elastic loan rewrite the tables."""

    def decode_start(self, rows: int) -> None:
        """Before a decode forward of ``rows`` rows, the tables being the decode's."""

    def routed(self, row: int, selected: torch.Tensor, weights: torch.Tensor | None, z: torch.Tensor | None) -> None:
        """After decode MoE layer ``row``'s router picked ``selected`` (int64 [rows, top_k]) with router ``weights``
        (which the part may change in place before the experts run) from the router's input ``z``."""

    def routed_sum(self, row: int, routed_sum: torch.Tensor) -> None:
        """On layer ``row``'s fp32 routed sum, which the part may add to in place."""

    def after_layer(self, row: int) -> None:
        """Once layer ``row``'s experts are launched (any forward)."""

    def after_step(self) -> None:
        """After the engine's step and its synchronisation."""

    def stats(self) -> dict | None:
        """The part's entry in ``/stats`` (None: none)."""
        return None

    def close(self) -> None:
        """Stop what the part started."""


def implementing(parts: Sequence[Part], hook: str) -> tuple[Part, ...]:
    """The parts, in their order, whose class defines ``hook`` (other than :class:`Part`'s own, which does nothing)."""
    default = getattr(Part, hook)
    return tuple(p for p in parts if getattr(type(p), hook, default) is not default)
