#!/usr/bin/env python3
"""The RAM tier's replacement policy replayed on routing traces on the CPU, as the engine runs the two levels, against
the offline optimum (issue 32).

Per MoE layer of a decode step the engine first resolves the picks the VRAM cache misses (``tiered.TieredHome``:
``ram_tier.missed``, then ``TierPolicy.step`` on the tier's policy slots), then runs the VRAM cache's step
(``cache_policy.ReferenceCache.step`` with ``Policy.from_settings``' parameters). This replays both, each level
started as the engine starts it (``ReferenceCache.warm`` as ``ExpertCache`` fills its slots, ``TierPolicy.state`` as
``RamTier.start``), from the routing profile a ``glm53 synth`` checkpoint ships (``cache_policy_sim.synth_profile``: what
the engine warm-starts from). The tier's size is a share of the experts, its budget as ``bench.ram_tier_decode``
gives it and its policy slots as ``ram_tier.plan`` makes them (the window, one layer's experts, comes out of the
budget). Reported per trace and share:

- ``disk_reads_per_token``: the tier's misses, the distinct experts a layer's step finds neither in VRAM nor in a
  policy slot (what ``RamTier.step`` reads from disk), summed over the layers, per decode step; ``admissions_per_token``
  the tier's admissions; both for each policy replayed (``first``: the tier's first policy, the VRAM cache's decay and
  hysteresis, no recency, the VRAM residents' scores at zero; ``default``: ``TierPolicy()``);
- ``belady_reads_per_token``: the offline optimum on the same miss stream, with the same slots per layer: the
  resident used again last out, or the missed expert itself when it is (bypass); a step's experts one after another,
  which may evict one the step already read (the tier cannot), so it is a ceiling no policy of the tier reaches;
- the VRAM cache's hit rate and misses per token (the tier's input).

Traces: ``--trace`` a recorded one (``.npy`` int [steps, layers, top_k], ``bench.routing_stats --trace-out``), ``--twin``
the CPU routing twin of the scaled checkpoint of a routing preset (``bench.routing_stats.twin_from_settings``);
without either, the engine's trace committed in bench/results and both presets' twins. ``--search`` replays a grid of
``TierPolicy`` parameters on every trace and share and ranks them against ``first``.

    python3 -m bench.ram_tier_sim [--trace T.npy] [--twin trained] [--steps 1000] [--shares 50,25] [--out sim.json]
    python3 -m bench.ram_tier_sim --search [--out search.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.cache_policy_sim import synth_profile
from bench.compare import card_gpu_experts
from bench.output import emit_json
from bench.ram_tier_decode import budget_bytes
from glm53 import config
from glm53.offload import ram_tier
from glm53.offload.cache import Policy
from glm53.offload.cache_policy import C_ADMITS, C_HITS, C_PICKS, ReferenceCache
from glm53.offload.ram_tier import TierPolicy
from glm53.tools.synth import presets

SCHEMA = "glm53.ram_tier_sim/1"
ENGINE_TRACE = REPO / "bench" / "results" / "2026-12-02-routing-trace-engine-trained-h200.npy"
SHARES = (50, 25)
NOMINAL_BLOCK = 1 << 20  # bytes of an expert block in the budget's arithmetic; the slot counts do not depend on it
SEARCH = {"decay": (0.999, 0.998, 0.997, 0.995), "hysteresis": (1.25, 1.5, 2.0, 3.0), "recency_weight": (0.0, 100.0, 800.0, 3000.0),
          "recency_decay": (0.5, 0.8), "vram_score": (0.0, 1.0)}


def engine_vram_policy() -> Policy:
    """The VRAM cache's parameters with the engine's default settings (exact mode, nothing set)."""
    return Policy.from_settings(config.load(["--mode", "exact"], {}))


def first_tier_policy(vram: Policy) -> TierPolicy:
    """The tier's first policy: the VRAM cache's decay and hysteresis, no recency, the VRAM residents' scores at zero."""
    return TierPolicy(decay=vram.decay, hysteresis=vram.hysteresis, recency_weight=0.0, vram_score=0.0)


def tier_slots(layers: int, experts: int, share: float) -> int:
    """The policy slots of a tier holding ``share`` % of the experts, as ``ram_tier.plan`` makes them from the budget
    ``bench.ram_tier_decode`` gives (0 when the window alone takes the budget)."""
    store = SimpleNamespace(num_layers=layers, num_experts=experts, layout=SimpleNamespace(block_bytes=NOMINAL_BLOCK),
                            arena_bytes=layers * experts * NOMINAL_BLOCK)
    tier = ram_tier.plan(store, budget_bytes(store, share))
    return store.num_layers * store.num_experts if tier is None else tier.policy_slots


@dataclasses.dataclass
class MissStream:
    """What reaches the tier: per decode step and layer the picks with -1 where VRAM held the expert."""

    missed: list[list[np.ndarray]]  # [steps][layers] int [top_k]
    vram_hit_rate: float
    vram_admissions: int

    @property
    def steps(self) -> int:
        return len(self.missed)


def vram_misses(trace: np.ndarray, profile: np.ndarray, vram_slots: int, policy: Policy) -> MissStream:
    """The VRAM cache's replay on ``trace`` (int [steps, layers, top_k]): the picks it misses, before each step."""
    top_k = trace.shape[2]
    cache = ReferenceCache.warm(profile, vram_slots, top_k, policy.decay, policy.recency)
    admit = policy.max_admit if vram_slots else 0
    missed = []
    for picks in trace:
        row = []
        for layer, selected in enumerate(picks):
            row.append(ram_tier.missed(selected, cache.slot_of[layer]))  # the tier's part acts before the cache's step
            cache.step(layer, selected, policy.decay, policy.hysteresis, admit, policy.recency)
        missed.append(row)
    counters = cache.counters
    return MissStream(missed, float(counters[:, C_HITS].sum() / max(counters[:, C_PICKS].sum(), 1)), int(counters[:, C_ADMITS].sum()))


def replay_tier(stream: MissStream, profile: np.ndarray, top_k: int, vram_slots: int, slots: int,
                policy: TierPolicy) -> tuple[int, int]:
    """(disk reads, admissions) of the tier's policy slots over ``stream``, started as ``RamTier.start`` starts them."""
    state = policy.state(profile, top_k, vram_slots, slots)
    reads = admitted = 0
    for row in stream.missed:
        for layer, missed in enumerate(row):
            distinct = np.unique(missed[missed >= 0])
            reads += int((state.slot_of[layer, distinct] < 0).sum())  # read before the step decides (RamTier.step)
            admitted += len(policy.step(state, layer, missed))
    return reads, admitted


def belady_reads(stream: MissStream, profile: np.ndarray, vram_slots: int, slots: int) -> int:
    """The offline optimum's disk reads on ``stream`` with the tier's slots per layer and starting residents."""
    start = TierPolicy().state(profile, 1, vram_slots, slots)  # placement alone decides the residents
    reads = 0
    for layer in range(profile.shape[0]):
        seq = [int(e) for row in stream.missed for e in np.unique(row[layer][row[layer] >= 0])]
        never = len(seq)
        next_use, seen = [never] * len(seq), {}
        for i in range(len(seq) - 1, -1, -1):
            next_use[i], seen[seq[i]] = seen.get(seq[i], never), i
        resident = {int(e): seen.get(int(e), never) for e in np.flatnonzero(start.slot_of[layer] >= 0)}
        for i, e in enumerate(seq):
            if e in resident:
                resident[e] = next_use[i]
                continue
            reads += 1
            if resident:
                far = max(resident, key=resident.get)
                if resident[far] > next_use[i]:
                    del resident[far]
                    resident[e] = next_use[i]
    return reads


def simulate(trace: np.ndarray, profile: np.ndarray, vram_slots: int, shares: Sequence[float],
             policies: dict[str, TierPolicy], vram: Policy) -> dict:
    """Every policy's disk reads and admissions per token and Belady's, per share of the experts."""
    layers, experts = profile.shape
    top_k = trace.shape[2]
    stream = vram_misses(trace, profile, vram_slots, vram)
    per_token = lambda n: round(n / stream.steps, 3)
    rows = {}
    for share in shares:
        slots = tier_slots(layers, experts, share)
        row = {"policy_slots": slots, "belady_reads_per_token": per_token(belady_reads(stream, profile, vram_slots, slots))}
        for name, policy in policies.items():
            reads, admitted = replay_tier(stream, profile, top_k, vram_slots, slots, policy)
            row[name] = {"disk_reads_per_token": per_token(reads), "admissions_per_token": per_token(admitted)}
        rows[f"{share:g}"] = row
    misses = sum(int((m >= 0).sum()) for row in stream.missed for m in row)
    return {"steps": stream.steps, "layers": layers, "experts": experts, "top_k": top_k, "vram_slots": vram_slots,
            "vram_hit_rate": round(stream.vram_hit_rate, 4), "vram_misses_per_token": per_token(misses),
            "vram_admissions_per_token": per_token(stream.vram_admissions), "by_share": rows}


def search(traces: dict[str, np.ndarray], profile: np.ndarray, vram_slots: int, shares: Sequence[float], vram: Policy,
           grid: dict[str, Sequence[float]] = SEARCH) -> list[dict]:
    """Every ``TierPolicy`` of ``grid`` (field -> values; the others at their defaults) on every trace and share: its
    disk reads over the first policy's, ranked by the worst case, then the mean."""
    layers, experts = profile.shape
    cases = []
    for (name, trace), share in itertools.product(traces.items(), shares):
        stream = vram_misses(trace, profile, vram_slots, vram)
        slots = tier_slots(layers, experts, share)
        replay = lambda policy, stream=stream, slots=slots, top_k=trace.shape[2]: replay_tier(stream, profile, top_k, vram_slots, slots, policy)[0]
        cases.append((f"{name}@{share:g}", replay, replay(first_tier_policy(vram))))
    ranked = []
    for values in itertools.product(*grid.values()):
        policy = TierPolicy(**dict(zip(grid, values)))
        ratios = {case: round(replay(policy) / max(first, 1), 4) for case, replay, first in cases}
        ranked.append({"policy": dataclasses.asdict(policy), "worst": max(ratios.values()),
                       "mean": round(float(np.mean(list(ratios.values()))), 4), "of_first": ratios})
    return sorted(ranked, key=lambda r: (r["worst"] > 1.0, r["mean"], r["worst"]))


def load_traces(paths: Sequence[Path], twins: Sequence[str], steps: int, seed: int, trace_seed: int) -> dict[str, np.ndarray]:
    """The traces by name: each recorded file's stem, ``twin-<routing>`` for each twin."""
    from bench.routing_stats import twin_from_settings

    traces = {Path(p).stem: np.load(p) for p in paths}
    for routing in twins:
        twin, _ = twin_from_settings("scaled", routing, seed, None)
        traces[f"twin-{routing}"] = twin.run(steps, trace_seed).picks
    return traces


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.ram_tier_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, action="append", default=[], help="a recorded trace (.npy int [steps, layers, top_k])")
    ap.add_argument("--twin", action="append", default=[], choices=tuple(presets.ROUTING_PRESETS), help="the scaled twin of a routing preset")
    ap.add_argument("--steps", type=int, default=1000, help="decode steps of each twin's trace")
    ap.add_argument("--seed", type=int, default=1, help="the twin's checkpoint seed (bench.compare's scaled checkpoint: 1)")
    ap.add_argument("--trace-seed", type=int, default=0)
    ap.add_argument("--shares", default=",".join(map(str, SHARES)), help="the tier's sizes, %% of the experts")
    ap.add_argument("--vram-slots", type=int, help="the VRAM cache's slots (default: bench.compare's, a 24 GB card's share)")
    ap.add_argument("--search", action="store_true", help="rank a grid of TierPolicy parameters against the first policy")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not args.trace and not args.twin:
        args.trace, args.twin = [ENGINE_TRACE], ["trained", "random"]
    profile = synth_profile("scaled")
    layers, experts = profile.shape
    vram_slots = args.vram_slots if args.vram_slots is not None else card_gpu_experts(experts) * layers
    shares = [float(s) for s in args.shares.split(",")]
    traces = load_traces(args.trace, args.twin, args.steps, args.seed, args.trace_seed)
    for name, trace in traces.items():
        if trace.shape[1] != layers or trace.max() >= experts:
            raise SystemExit(f"trace {name} is {trace.shape} with experts up to {trace.max()}; the profile is {layers} x {experts}")
    vram = engine_vram_policy()
    command = ["python3", "-m", "bench.ram_tier_sim", *(sys.argv[1:] if argv is None else argv)]
    if args.search:
        ranked = search(traces, profile, vram_slots, shares, vram)
        emit_json({"schema": SCHEMA, "command": command, "vram_slots": vram_slots, "traces": sorted(traces), "ranked": ranked}, args.out)
        return 0
    policies = {"first": first_tier_policy(vram), "default": TierPolicy()}
    result = {"schema": SCHEMA, "command": command, "policies": {n: dataclasses.asdict(p) for n, p in policies.items()},
              "vram_policy": dataclasses.asdict(vram),
              "traces": {name: simulate(trace, profile, vram_slots, shares, policies, vram) for name, trace in traces.items()}}
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
