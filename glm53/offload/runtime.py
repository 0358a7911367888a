"""The running offload: what the model's hooks call, statistics and shutdown. ``glm53.engine.exl3.offload`` starts
it on a model (scan, pin, attach, size and fill the cache, staging, CPU tier, prefetch) and installs the hooks that
call it.

The offload's optional parts (``part.Part``: the expert cache, prefetch, the CPU tier) are called in a loop, each
hook on the parts that implement it. Decode (a forward of at most ``Policy.decode_rows`` rows per MoE layer): after
each layer's routing, prefetch waits for the layer's copies, one kernel counts hits, admits and rewrites tables
(``ExpertCache.routed``), then the CPU tier (fast mode) takes its share of the misses. A large forward (prefill):
the first module's forward sees its size first (:meth:`forward_start`); the cache lends ``ec_elastic_gb`` of its
coldest slots, staging buffers are allocated and layers 0 and 1 start copying. The next small forward gives the
staging VRAM back and restores the lent slots with the experts they held.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from ..config import GB, Settings
from . import budget, profile
from .cache import ExpertCache, Policy
from .host_store import HostStore, cuda_unregister
from .part import HOOKS, Part, implementing
from .staging import PrefillStager

log = logging.getLogger(__name__)

STAGE_MIN_ROWS = 256  # forwards with at least this many tokens stage experts (below, zero-copy reads suffice)


class Offload:
    """The offload of one loaded model.

    :param parts: the optional parts in the order each hook calls them; ``routed``'s order is the one that matters:
        prefetch first (the cache's step waits for the layer's prefetch), then the cache (its step rewrites the
        tables), then the CPU tier (it splits what the cache's step left missed); the link's miss count comes last.
    :param cpu_tier_off_reason: why ``GLM53_CT_ENABLE=auto`` left the CPU tier off, for ``/stats``.
    :param vram: the VRAM budget's figures (``budget.cache_slots``).
    :param timings: seconds of the start's steps, for ``/stats``.
    """

    def __init__(self, settings: Settings, store: HostStore, cache: ExpertCache, stager: PrefillStager, *, device: torch.device,
                 policy: Policy, vram: dict, profile_source: str, timings: dict[str, float], parts: Sequence[Part] = (),
                 cpu_tier_off_reason: str | None = None):
        self.settings = settings
        self.model_dir = Path(settings.model_dir)
        self.store, self.cache, self.stager = store, cache, stager
        self.device, self.policy, self.budget = device, policy, vram
        self.profile_source, self.timings = profile_source, timings
        self.cpu_tier_off_reason = cpu_tier_off_reason
        self.removers: list[Callable[[], None]] = []  # the model's hooks, taken off by close()
        self.prefilling = False  # between a large forward and the next small one
        self._attach(tuple(parts))

    def _attach(self, parts: tuple[Part, ...]) -> None:
        self.parts = parts
        self._hooked = {hook: implementing(parts, hook) for hook in HOOKS}
        self._tiered = self.part("ram_tier")  # ``tiered.TieredHome``: acts on every forward's routing, first

    def part(self, name: str) -> Part | None:
        """The part of this ``name`` (``Part.name``), or None."""
        return next((p for p in self.parts if p.name == name), None)

    @property
    def tier(self):
        """Fast mode's CPU tier (``glm53.cpu_tier.tier.FastTier``), or None."""
        return self.part("cpu_tier")

    @property
    def prefetch(self):
        """The decode's predictive prefetch (``glm53.offload.prefetch.Prefetcher``), or None."""
        return self.part("prefetch")

    def hooks(self, hook: str) -> tuple[Part, ...]:
        """The parts that implement ``hook`` (the engine installs a model hook only where one does)."""
        return self._hooked[hook]

    @contextmanager
    def detached(self, part: Part) -> Iterator[None]:
        """Within: the hooks do not see ``part`` (a measurement tool's run without it, on the same engine)."""
        before = self.parts
        self._attach(tuple(p for p in before if p is not part))
        try:
            yield
        finally:
            self._attach(before)

    # ---- per step (the engine's thread, around its step)

    def before_step(self) -> None:
        for part in self._hooked["before_step"]:
            part.before_step()

    def after_step(self) -> None:
        for part in self._hooked["after_step"]:
            part.after_step()

    # ---- per forward and layer (the generator's thread, on the compute stream)

    def forward_start(self, rows: int) -> None:
        """Before the model's forward of ``rows`` tokens (all sequences together)."""
        for part in self._hooked["forward_start"]:
            part.forward_start()  # before the tables change hands (staging, the loan's return)
        if rows >= STAGE_MIN_ROWS:
            self.prefilling = True
            if self.stager.enabled:
                headroom = self._vram_headroom()
                want = self.stager.wanted_bytes()
                if headroom < want and self.settings.ec_elastic_gb > 0 and not self.cache.lent:
                    # borrow only what staging lacks: every lent expert is read from host memory until decode
                    self.cache.lend(min(int(self.settings.ec_elastic_gb * GB), want - headroom))
                    headroom = self._vram_headroom()
                self.stager.begin(headroom)
        elif self.prefilling or self.cache.lent:
            self.prefilling = False
            self.stager.release()
            self.cache.restore()
        if rows <= self.policy.decode_rows and not self.prefilling:
            for part in self._hooked["decode_start"]:
                part.decode_start(rows)  # last: the tables are the decode's again

    def routed(self, row: int, selected: torch.Tensor, weights: torch.Tensor | None = None, z: torch.Tensor | None = None) -> None:
        """After MoE layer ``row``'s router picked ``selected`` (int64 [rows, top_k]) with router ``weights`` (which a
        part may change in place) from the router's input ``z``."""
        decode = selected.shape[0] <= self.policy.decode_rows and not self.prefilling
        if self._tiered is not None and not self.stager.feeding:  # before anything reads an expert: each pick's home
            self._tiered.place(row, selected, decode, z)            # must hold its bytes (staging saw to it when feeding)
        if decode:
            for part in self._hooked["routed"]:  # in the parts' order: prefetch, the cache, the CPU tier
                part.routed(row, selected, weights, z)
        # last: the tables and the weights now say which experts the layer's kernels read from the host store
        self.cache.link.misses(self.cache.state, row, selected, weights, self.cache.block_bytes)

    def routed_sum(self, row: int, routed_sum: torch.Tensor) -> torch.Tensor:
        """Layer ``row``'s fp32 routed sum, which the parts add to in place."""
        for part in self._hooked["routed_sum"]:
            part.routed_sum(row, routed_sum)
        return routed_sum

    def before_layer(self, row: int) -> None:
        if self.stager.active:
            self.stager.before_layer(row)

    def after_layer(self, row: int) -> None:
        if self.stager.active:
            self.stager.after_layer(row)
        for part in self._hooked["after_layer"]:
            part.after_layer(row)

    def _vram_headroom(self) -> int:
        return budget.headroom(self.device, self.budget)

    # ---- reporting and shutdown

    def stats(self) -> dict:
        out = {"host_store": self.store.describe(), "timings": self.timings}
        if self.cache is not None:
            out["vram_budget"] = self.budget
            out["staging"] = self.stager.stats()
            out["link"] = self.cache.link.stats()
        if self.cpu_tier_off_reason is not None:
            out["cpu_tier"] = {"off": self.cpu_tier_off_reason}
        for part in self.parts:
            entry = part.stats()
            if entry is not None:
                out[part.name] = entry
        if "cache" in out:
            out["cache"]["profile"] = self.profile_source
        return out

    def save_learned_profile(self) -> Path | None:
        path = profile.learned_path(self.model_dir, self.settings.root)
        if path is None or self.cache is None:
            return None
        picks = self.cache.learned_profile()
        if picks.sum() == 0:
            return None
        profile.save_learned(path, self.store.layer_keys, picks)
        return path

    def close(self) -> None:
        try:
            self.save_learned_profile()
        except OSError as e:
            log.warning("could not save the learned routing profile: %s", e)
        for remove in reversed(self.removers):
            remove()
        self.removers.clear()
        for part in reversed(self.parts):
            part.close()
        self._attach(())
        if self.stager is not None:
            self.stager.release()
        self.cache = None
        torch.cuda.synchronize(self.device)
        self.store.unpin(cuda_unregister)
