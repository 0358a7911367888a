"""How the CPU tier follows the host between steps (``controller.Controller``): one frozen object, the defaults below
measured on the H200 host. A running tier takes another (``FastTier.retune``): ``bench.fast_ablation``'s runs pass
variants of it (the hooks weighed at nothing, charged their GPU time, no probes, no refreshes)."""

from __future__ import annotations

from dataclasses import dataclass

HOOK_COSTS = ("host", "gpu")


@dataclass(frozen=True)
class Tuning:
    refresh_steps: int = 8  # steps between refreshes of the cost table from live timings (a busy host is seen this soon)
    sample_steps: int = 8  # one decode step in this many has its layers' GPU part timed
    probe_steps: int = 8  # resting, the first probe step comes this many steps after the rest began
    probe_steps_max: int = 512  # ... and the interval doubles up to this after each probe that did not lower the CPU figures
    # resting, a probe whose live figures would have the split save this share of the hooks' cost (or, the hooks not
    # yet timed, save anything) keeps the next probe probe_steps away: the host is near paying
    probe_near: float = 0.5
    probe_experts: int = 2  # experts of a shadow job
    table_drift: float = 0.03  # a refresh rebuilds the split table when a figure it is built from moved by more than this share
    starved_share: float = 0.1  # a refresh window whose jobs went unclaimed past their deadline more often than this: starved
    late_share: float = 0.05  # a refresh window with more late jobs (computed by the GPU after all) than this: the CPU is slower
    slower: float = 2.0  # ... and its figures are multiplied by this (they come back down by at most 1.25x a clean window)
    stop_loss_floor_s: float = 300e-6  # the GPU waits at least this long for a job (its jitter), at most its experts' link time
    hook_margin: float = 1.25  # resting for its hooks' cost, the tier comes back once its predicted saving is this much higher
    # the share of the hooks' cost per layer counted against the split's saving (bench.fast_ablation's no-rest run sets
    # 0: is that cost real at all while the thread feeding the GPU runs milliseconds ahead of it?)
    hook_weight: float = 1.0
    # what the hooks cost, for Worth: "host", the feeding thread's time in them; "gpu", their time on the GPU's clock in
    # sampled layers that sent the CPU nothing (the split, and the collect to the fallback's launch), the currency of
    # the split's own table (bench.fast_ablation's gpu-worth run)
    hook_cost: str = "host"

    def __post_init__(self):
        counts = ("refresh_steps", "sample_steps", "probe_steps", "probe_steps_max", "probe_experts")
        if any(getattr(self, name) < 1 for name in counts):
            raise ValueError(f"{', '.join(counts)} must be >= 1: {self}")
        shares = ("probe_near", "table_drift", "starved_share", "late_share", "stop_loss_floor_s", "hook_weight")
        if any(getattr(self, name) < 0 for name in shares) or self.slower < 1 or self.hook_margin < 1:
            raise ValueError(f"{', '.join(shares)} must be >= 0 and slower, hook_margin >= 1: {self}")
        if self.hook_cost not in HOOK_COSTS:
            raise ValueError(f"hook_cost must be one of {HOOK_COSTS}, not {self.hook_cost!r}")
