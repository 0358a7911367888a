"""A sequence's grammar constraint as an exllamav3 filter (public ``exllamav3.Filter`` interface, 1.6.5).

exllamav3 asks every active filter of a batch for its mask on its filter thread pool just before it queues the
forward, and collects the masks after the forward, before sampling (``Generator.iterate``): the mask of a
constrained sequence is computed on a CPU thread while the GPU runs, off the decode step's critical path. The
packed int32 bitmask goes to the sampling kernels as it is. exllamav3 then feeds the filter each sampled token.

The filter never ends the job itself (``eos_after_completed`` is off): the scheduler sees where the grammar ended
and removes the sequence, as for any other stop.
"""

from __future__ import annotations

import numpy as np
import torch
from exllamav3 import Filter

from ..constraints import Constraint


class GrammarFilter(Filter):
    def __init__(self, constraint: Constraint, tokenizer):
        """:param tokenizer: exllamav3's tokenizer of the job's generator."""
        super().__init__(tokenizer, trigger_token=None, prefix_str=None, eos_after_completed=False)
        self._constraint = constraint
        self._mask = np.zeros((1, constraint.mask_words), dtype=np.int32)  # [1, W], reused: exllamav3 copies it out
        self._mask_torch = torch.from_numpy(self._mask)

    def reset(self) -> None:
        # called when the job first starts, when the constraint is fresh; a requeued job keeps its filter's state
        pass

    def accept_token(self, token: int) -> None:
        self._constraint.advance(token)

    def is_completed(self) -> bool:
        return self._constraint.ended_at is not None

    def get_next_logit_mask(self) -> torch.Tensor:
        self._constraint.fill_mask(self._mask[0])
        return self._mask_torch

    def use_background_worker(self) -> bool:
        return True
