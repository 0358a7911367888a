#!/usr/bin/env python3
"""The RAM tier's replacement policy replayed on routing traces on the CPU, as the engine runs the two levels, against
the offline optimum (issue 32).

Per MoE layer of a decode step the engine first resolves the picks the VRAM cache misses (``tiered.TieredHome``:
``ram_tier.missed``, then ``TierPolicy.step`` on the tier's policy slots), then runs the VRAM cache's step
(``cache_policy.ReferenceCache.step`` with ``Policy.from_settings``' parameters: the engine's defaults, or
``--vram-decay`` / ``--vram-recency-weight`` as ``GLM53_EC_DECAY`` / ``GLM53_EC_RECENCY_WEIGHT`` set them). This replays both, each level
started as the engine starts it (``ReferenceCache.warm`` as ``ExpertCache`` fills its slots, ``TierPolicy.state`` as
``RamTier.start``), from the routing profile a ``glm53 synth`` checkpoint ships (``cache_policy_sim.synth_profile``: what
the engine warm-starts from). The tier's size is a share of the experts, its budget as ``bench.ram_tier_decode``
gives it and its policy slots as ``ram_tier.plan`` makes them (the window, one layer's experts, comes out of the
budget). Reported per trace and share:

- ``disk_reads_per_token``: the tier's misses, the distinct experts a layer's step finds neither in VRAM nor in a
  policy slot (what ``RamTier.step`` reads from disk), summed over the layers, per decode step; ``admissions_per_token``
  the tier's admissions; ``duplicates_mean`` the policy slots holding an expert VRAM holds after a step; each for every
  policy replayed (``first``: the tier's first policy, the VRAM cache's decay and hysteresis of then, 0.999 and 1.25,
  no recency, the VRAM residents' scores at zero, slots shared with VRAM; ``default``: ``TierPolicy()``, exclusive
  of VRAM after ``exclusive_after`` steps; ``shared``: the default not exclusive; ``exclusive-at-once``: exclusive
  from the first step; any ``--policy``), and for ``default`` and ``exclusive-at-once`` with VRAM's evictions written
  back into a policy slot (``NAME+write-back``, as a copy back over the link would: the engine has none, so this
  says what one would add; ``--no-write-back`` leaves them out);
- ``belady_reads_per_token``: the offline optimum on the same miss stream, with the same slots per layer: the
  resident used again last out, or the missed expert itself when it is (bypass); a step's experts one after another,
  which may evict one the step already read (the tier cannot), so it is a ceiling no policy of the tier reaches
  (a write-back fills slots without a read, so it can pass it);
- the VRAM cache's hit rate and misses per token (the tier's input).

Traces: ``--trace`` a recorded one (``.npy`` int [steps, layers, top_k], ``bench.routing_stats --trace-out``), ``--twin``
the CPU routing twin of the scaled checkpoint of a routing preset (``bench.routing_stats.twin_from_settings``);
without either, the engine's trace committed in bench/results and both presets' twins. ``--window 97`` replays a
recorded trace as windows of bench.compare's decode instead (its arm's 97 decode steps: a warm-up job of 32 tokens,
the timed job of 64, the prefill job's one), each from the warm start: what one GPU arm measures, and how much that
varies with the stretch of routing it sees. ``--search`` replays a grid of ``TierPolicy`` parameters (``--grid`` to
change a field's values) on every trace and share and ranks them against ``first`` and ``default``.

    python3 -m bench.ram_tier_sim [--trace T.npy] [--twin trained] [--steps 1000] [--shares 50,25] [--window 97]
        [--vram-decay 0.999 --vram-recency-weight 800] [--policy NAME=decay:0.995,exclusive_after:16,...]
        [--no-write-back] [--out sim.json]
    python3 -m bench.ram_tier_sim --search [--grid decay=0.999,0.995] [--jobs 2] [--out search.json]
    python3 -m bench.ram_tier_sim --read-ahead 1,2,4 [--twin trained] [--out ahead.json]

``--read-ahead`` replays instead what reading ahead the first N of the next layer's guesses (its router on this
layer's state, the twins' ``bench.routing_stats`` guesses) would have started early: per token, the disk reads, the
guesses, those the next step read (covered), their precision and recall (:func:`read_ahead`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import multiprocessing
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
SEARCH = {"decay": (0.999, 0.997, 0.995, 0.99), "hysteresis": (1.1, 1.25, 1.5), "recency_weight": (0.0, 200.0, 800.0),
          "recency_decay": (0.5, 0.8), "vram_score": (0.0, 1.0)}


# the tier's first policy: the VRAM cache's decay and hysteresis of then (0.999, 1.25), no recency, the VRAM residents'
# scores at zero; fixed here, as the VRAM cache's own defaults have moved since
FIRST_POLICY = TierPolicy(decay=0.999, hysteresis=1.25, recency_weight=0.0, vram_score=0.0,
                          exclusive=False)


def engine_vram_policy(decay: float | None = None, recency_weight: float | None = None) -> Policy:
    """The VRAM cache's parameters as the engine takes them from its settings (exact mode): the defaults, or what
    ``GLM53_EC_DECAY`` / ``GLM53_EC_RECENCY_WEIGHT`` would set."""
    argv = ["--mode", "exact"]
    if decay is not None:
        argv += ["--ec-decay", str(decay)]
    if recency_weight is not None:
        argv += ["--ec-recency-weight", str(recency_weight)]
    return Policy.from_settings(config.load(argv, {}))


def tier_slots(layers: int, experts: int, share: float) -> int:
    """The policy slots of a tier holding ``share`` % of the experts, as ``ram_tier.plan`` makes them from the budget
    ``bench.ram_tier_decode`` gives (0 when the window alone takes the budget)."""
    store = SimpleNamespace(num_layers=layers, num_experts=experts, layout=SimpleNamespace(block_bytes=NOMINAL_BLOCK),
                            arena_bytes=layers * experts * NOMINAL_BLOCK)
    tier = ram_tier.plan(store, budget_bytes(store, share))
    return store.num_layers * store.num_experts if tier is None else tier.policy_slots


@dataclasses.dataclass
class MissStream:
    """What reaches the tier: per decode step and layer the picks with -1 where VRAM held the expert, VRAM's residency
    then (what ``TieredHome.resolve`` gives the tier's step) and the VRAM cache's step's (admitted, evicted) experts."""

    missed: list[list[np.ndarray]]  # [steps][layers] int [top_k]
    vram_hit_rate: float
    vram_admissions: int
    vram: list[list[np.ndarray]] = dataclasses.field(default_factory=list)  # [steps][layers] int32 [experts]: slot or -1
    swaps: list[list[list[tuple[int, int]]]] = dataclasses.field(default_factory=list)  # [steps][layers] (admitted, evicted)

    @property
    def steps(self) -> int:
        return len(self.missed)


def vram_misses(trace: np.ndarray, profile: np.ndarray, vram_slots: int, policy: Policy) -> MissStream:
    """The VRAM cache's replay on ``trace`` (int [steps, layers, top_k]): the picks it misses, before each step."""
    top_k = trace.shape[2]
    cache = ReferenceCache.warm(profile, vram_slots, top_k, policy.decay, policy.recency, policy.warm_horizon)
    admit = policy.max_admit if vram_slots else 0
    missed, vram, swaps = [], [], []
    for picks in trace:
        row, held, moved = [], [], []
        for layer, selected in enumerate(picks):
            row.append(ram_tier.missed(selected, cache.slot_of[layer]))  # the tier's part acts before the cache's step
            held.append(cache.slot_of[layer].copy())
            admitted = cache.step(layer, selected, policy.decay, policy.hysteresis, admit, policy.recency)
            moved.append([(a.expert, a.evicted) for a in admitted])
        missed.append(row)
        vram.append(held)
        swaps.append(moved)
    counters = cache.counters
    return MissStream(missed, float(counters[:, C_HITS].sum() / max(counters[:, C_PICKS].sum(), 1)), int(counters[:, C_ADMITS].sum()),
                      vram, swaps)


@dataclasses.dataclass
class Replay:
    """A tier policy's replay over a miss stream."""

    reads: int  # from disk
    admitted: int  # the policy's admissions (with write-back, the written-back experts too)
    duplicates: float  # policy slots holding an expert VRAM holds, over the layers, on average after a decode step
    written_back: int = 0


def replay_tier(stream: MissStream, profile: np.ndarray, top_k: int, vram_slots: int, slots: int,
                policy: TierPolicy, write_back: bool = False) -> Replay:
    """The tier's policy slots over ``stream``, started as ``RamTier.start`` starts them and stepped as
    ``RamTier.step`` steps them (``TierPolicy.step`` with the layer's VRAM residency). ``write_back``: after the VRAM
    cache's step, each expert it evicted that no policy slot holds is put back into one (``TierPolicy.write_back``),
    as the engine's write-back copies it from VRAM (``GLM53_RAM_TIER_WRITE_BACK``)."""
    state = policy.state(profile, top_k, vram_slots, slots)
    reads = admitted = written = duplicates = 0
    for missed_row, vram_row, swaps_row in zip(stream.missed, stream.vram, stream.swaps):
        for layer, (missed, vram, swaps) in enumerate(zip(missed_row, vram_row, swaps_row)):
            distinct = np.unique(missed[missed >= 0])
            reads += int((state.slot_of[layer, distinct] < 0).sum())  # read before the step decides (RamTier.step)
            admitted += len(policy.step(state, layer, missed, vram))
            held = vram >= 0
            for c, v in swaps:
                held[c], held[v] = True, False
            if write_back:
                written += sum(policy.write_back(state, layer, v, held, distinct) is not None for _, v in swaps)
            duplicates += int((held & (state.slot_of[layer] >= 0)).sum())
    return Replay(reads, admitted + written, duplicates / max(len(stream.missed), 1), written)


def read_ahead(stream: MissStream, guesses: np.ndarray, profile: np.ndarray, top_k: int, vram_slots: int, slots: int,
               policy: TierPolicy, counts: Sequence[int]) -> dict[int, dict[str, int]]:
    """What reads ahead (``GLM53_RAM_TIER_READ_AHEAD``) would have started early, replaying the tier as
    :func:`replay_tier` does: per layer step after the first, the next layer's guesses (``guesses`` int [steps,
    layers - 1, n]: layer l + 1's router on layer l's state, best first) that neither VRAM nor a policy slot holds, as
    ``TieredHome.guess`` and ``RamTier.read_ahead`` filter them; of the first ``n`` of those (for each ``n`` of
    ``counts``), how many the step then reads from disk (``covered``: its read started a layer early) and how many
    it does not (``wasted``: dropped, what their pieces read in the meantime lost). ``{n: {reads, guessed, covered}}``."""
    state = policy.state(profile, top_k, vram_slots, slots)
    out = {n: {"reads": 0, "guessed": 0, "covered": 0} for n in counts}
    for step, (missed_row, vram_row) in enumerate(zip(stream.missed, stream.vram)):
        for layer, (missed, vram) in enumerate(zip(missed_row, vram_row)):
            distinct = np.unique(missed[missed >= 0])
            disk = {int(e) for e in distinct if state.slot_of[layer, e] < 0}
            if layer:
                candidates = [int(e) for e in guesses[step, layer - 1] if vram[e] < 0 and state.slot_of[layer, e] < 0]
                for n, row in out.items():
                    chosen = candidates[:n]
                    row["guessed"] += len(chosen)
                    row["covered"] += len(disk.intersection(chosen))
            for row in out.values():
                row["reads"] += len(disk)
            policy.step(state, layer, missed, vram)
    return out


def read_ahead_report(routing: str, steps: int, seed: int, trace_seed: int, profile: np.ndarray, vram_slots: int,
                      shares: Sequence[float], vram: Policy, counts: Sequence[int]) -> dict:
    """:func:`read_ahead` on the CPU twin of ``routing`` (its guesses are its router's, ``bench.routing_stats``'s)
    with the tier's default policy, per share: per token the disk reads, the guesses read ahead, those covered, and
    their precision (covered / guessed) and recall (covered / reads)."""
    from bench.routing_stats import twin_from_settings, twin_trace

    twin, _ = twin_from_settings("scaled", routing, seed, None)
    trace, guesses = twin_trace(twin, steps, trace_seed)
    stream = vram_misses(trace, profile, vram_slots, vram)
    layers, experts = profile.shape
    rows = {}
    for share in shares:
        got = read_ahead(stream, guesses, profile, trace.shape[2], vram_slots, tier_slots(layers, experts, share), TierPolicy(), counts)
        rows[f"{share:g}"] = {str(n): {"disk_reads_per_token": round(r["reads"] / steps, 3), "guessed_per_token": round(r["guessed"] / steps, 3),
                                       "covered_per_token": round(r["covered"] / steps, 3),
                                       "precision": round(r["covered"] / max(r["guessed"], 1), 3),
                                       "recall": round(r["covered"] / max(r["reads"], 1), 3)} for n, r in got.items()}
    return {"routing": routing, "steps": steps, "seed": seed, "trace_seed": trace_seed, "by_share": rows}


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
             policies: dict[str, TierPolicy], vram: Policy, write_back: Sequence[str] = ()) -> dict:
    """Every policy's disk reads and admissions per token and Belady's, per share of the experts; the policies named
    in ``write_back`` also with the VRAM cache's evictions written back (``NAME+write-back``, :func:`replay_tier`)."""
    layers, experts = profile.shape
    top_k = trace.shape[2]
    stream = vram_misses(trace, profile, vram_slots, vram)
    per_token = lambda n: round(n / stream.steps, 3)
    rows = {}
    for share in shares:
        slots = tier_slots(layers, experts, share)
        row = {"policy_slots": slots, "belady_reads_per_token": per_token(belady_reads(stream, profile, vram_slots, slots))}
        runs = [(name, policy, False) for name, policy in policies.items()] + [(f"{n}+write-back", policies[n], True) for n in write_back]
        for name, policy, back in runs:
            got = replay_tier(stream, profile, top_k, vram_slots, slots, policy, back)
            row[name] = {"disk_reads_per_token": per_token(got.reads), "admissions_per_token": per_token(got.admitted),
                         "duplicates_mean": round(got.duplicates, 1)}
            if back:
                row[name]["written_back_per_token"] = per_token(got.written_back)
        rows[f"{share:g}"] = row
    misses = sum(int((m >= 0).sum()) for row in stream.missed for m in row)
    return {"steps": stream.steps, "layers": layers, "experts": experts, "top_k": top_k, "vram_slots": vram_slots,
            "vram_hit_rate": round(stream.vram_hit_rate, 4), "vram_misses_per_token": per_token(misses),
            "vram_admissions_per_token": per_token(stream.vram_admissions), "by_share": rows}


def search(traces: dict[str, np.ndarray], profile: np.ndarray, vram_slots: int, shares: Sequence[float], vram: Policy,
           grid: dict[str, Sequence[float]] = SEARCH, baselines: dict[str, TierPolicy] | None = None, jobs: int = 1) -> list[dict]:
    """Every ``TierPolicy`` of ``grid`` (field -> values; the others at their defaults) on every trace and share: its
    disk reads over each baseline's (default: the first policy and ``TierPolicy()``) and over the fewest of them,
    ranked by the worst case of the last (above 1: more than a baseline somewhere), then its mean. ``jobs``
    processes replay the grid (forked: they inherit the cases)."""
    baselines = baselines or {"first": FIRST_POLICY, "default": TierPolicy()}
    layers, experts = profile.shape
    names = []
    _SEARCH_CASES.clear()
    for (name, trace), share in itertools.product(traces.items(), shares):
        names.append(f"{name}@{share:g}")
        _SEARCH_CASES.append((vram_misses(trace, profile, vram_slots, vram), profile, trace.shape[2], vram_slots,
                              tier_slots(layers, experts, share)))
    policies = [TierPolicy(**dict(zip(grid, values))) for values in itertools.product(*grid.values())]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        base = dict(zip(baselines, pool.map(_search_reads, baselines.values())))
        reads = pool.map(_search_reads, policies, chunksize=4)
    fewest = [max(min(r[i] for r in base.values()), 1) for i in range(len(names))]
    ranked = []
    for policy, got in zip(policies, reads):
        best = {case: round(n / f, 4) for case, n, f in zip(names, got, fewest)}
        ranked.append({"policy": dataclasses.asdict(policy), "worst": max(best.values()), "mean": round(float(np.mean(list(best.values()))), 4),
                       "of_best_baseline": best,
                       **{f"of_{b}": {case: round(n / max(r, 1), 4) for case, n, r in zip(names, got, base[b])} for b in baselines}})
    return sorted(ranked, key=lambda r: (r["worst"] > 1.0, r["mean"], r["worst"]))


_SEARCH_CASES: list[tuple] = []  # the search's replays (stream, profile, top_k, vram_slots, policy slots), which its forked workers inherit


def _search_reads(policy: TierPolicy) -> list[int]:
    return [replay_tier(stream, profile, top_k, vram_slots, slots, policy).reads
            for stream, profile, top_k, vram_slots, slots in _SEARCH_CASES]


def load_traces(paths: Sequence[Path], twins: Sequence[str], steps: int, seed: int, trace_seed: int,
                window: int | None = None) -> dict[str, np.ndarray]:
    """The traces by name: each recorded file's stem, ``twin-<routing>`` for each twin. With ``window``, a recorded
    trace longer than it is replayed as windows of that many steps instead (``stem[a:b]``, spread evenly from its
    start to its end, each from the warm start), as ``bench.compare``'s arm decodes: 97 steps over three requests."""
    from bench.routing_stats import twin_from_settings

    traces = {}
    for path in paths:
        trace = np.load(path)
        steps_in = trace.shape[0]
        if window is None or window >= steps_in:
            traces[Path(path).stem] = trace
            continue
        for a in np.unique(np.round(np.linspace(0, steps_in - window, -(-steps_in // window))).astype(int)):
            traces[f"{Path(path).stem}[{a}:{a + window}]"] = trace[a:a + window]
    for routing in twins:
        twin, _ = twin_from_settings("scaled", routing, seed, None)
        traces[f"twin-{routing}"] = twin.run(steps, trace_seed).picks
    return traces


def _field_value(field: str, text: str) -> float | int | bool:
    """A ``TierPolicy`` field's value from text, of the field's type: a bool 0/1/false/true, an int, else a float."""
    kind = {f.name: f.type for f in dataclasses.fields(TierPolicy)}.get(field)
    if kind == "bool":
        if text.strip().lower() not in ("0", "1", "false", "true"):
            raise ValueError(f"{field}:{text} is not 0, 1, false or true")
        return text.strip().lower() in ("1", "true")
    return int(text) if kind == "int" else float(text)


def parse_policy(text: str) -> tuple[str, TierPolicy]:
    """``NAME=field:value,...`` (``TierPolicy``'s fields; the others at their defaults) as (name, policy)."""
    name, _, fields = text.partition("=")
    try:
        given = {k.strip(): _field_value(k.strip(), v) for k, v in (item.split(":") for item in fields.split(",") if item.strip())}
        return name.strip(), TierPolicy(**given)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"--policy {text!r}: {exc} (give NAME=field:value,..., fields of TierPolicy)") from exc


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.ram_tier_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, action="append", default=[], help="a recorded trace (.npy int [steps, layers, top_k])")
    ap.add_argument("--twin", action="append", default=[], choices=tuple(presets.ROUTING_PRESETS), help="the scaled twin of a routing preset")
    ap.add_argument("--steps", type=int, default=1000, help="decode steps of each twin's trace")
    ap.add_argument("--seed", type=int, default=1, help="the twin's checkpoint seed (bench.compare's scaled checkpoint: 1)")
    ap.add_argument("--trace-seed", type=int, default=0)
    ap.add_argument("--shares", default=",".join(map(str, SHARES)), help="the tier's sizes, %% of the experts")
    ap.add_argument("--vram-slots", type=int, help="the VRAM cache's slots (default: bench.compare's, a 24 GB card's share)")
    ap.add_argument("--window", type=int, help="replay each recorded trace as windows of this many decode steps (bench.compare's arm: 97)")
    ap.add_argument("--vram-decay", type=float, help="the VRAM cache's decay (GLM53_EC_DECAY; default: the engine's)")
    ap.add_argument("--vram-recency-weight", type=float, help="the VRAM cache's recency weight (GLM53_EC_RECENCY_WEIGHT; default: the engine's)")
    ap.add_argument("--policy", type=parse_policy, action="append", default=[], metavar="NAME=FIELD:VALUE,...",
                    help="a TierPolicy to replay beside the first policy and the default (its other fields at their defaults)")
    ap.add_argument("--no-write-back", action="store_true", help="leave out the replays with VRAM's evictions written back")
    ap.add_argument("--search", action="store_true", help="rank a grid of TierPolicy parameters against the first policy and the default")
    ap.add_argument("--grid", action="append", default=[], metavar="FIELD=V1,V2,...", help="with --search: a field's values instead of the grid's")
    ap.add_argument("--jobs", type=int, default=1, help="with --search: processes replaying the grid")
    ap.add_argument("--read-ahead", metavar="N1,N2,...", help="instead: what reads ahead of the first N guesses would have "
                    "started early, on the twins (--twin, default both), per share")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    grid = dict(SEARCH)
    for item in args.grid:
        field, _, values = item.partition("=")
        if field not in {f.name for f in dataclasses.fields(TierPolicy)}:
            ap.error(f"--grid {item!r}: {field!r} is not a field of TierPolicy")
        grid[field] = tuple(_field_value(field, v) for v in values.split(","))
    profile = synth_profile("scaled")
    layers, experts = profile.shape
    vram_slots = args.vram_slots if args.vram_slots is not None else card_gpu_experts(experts) * layers
    shares = [float(s) for s in args.shares.split(",")]
    command = ["python3", "-m", "bench.ram_tier_sim", *(sys.argv[1:] if argv is None else argv)]
    vram = engine_vram_policy(args.vram_decay, args.vram_recency_weight)
    if args.read_ahead:
        counts = [int(n) for n in args.read_ahead.split(",")]
        emit_json({"schema": SCHEMA, "command": command, "vram_slots": vram_slots, "vram_policy": dataclasses.asdict(vram),
                   "tier_policy": dataclasses.asdict(TierPolicy()), "read_ahead": [
                       read_ahead_report(r, args.steps, args.seed, args.trace_seed, profile, vram_slots, shares, vram, counts)
                       for r in args.twin or ["trained", "random"]]}, args.out)
        return 0
    if not args.trace and not args.twin:
        args.trace, args.twin = [ENGINE_TRACE], ["trained", "random"]
    traces = load_traces(args.trace, args.twin, args.steps, args.seed, args.trace_seed, args.window)
    for name, trace in traces.items():
        if trace.shape[1] != layers or trace.max() >= experts:
            raise SystemExit(f"trace {name} is {trace.shape} with experts up to {trace.max()}; the profile is {layers} x {experts}")
    if args.search:
        ranked = search(traces, profile, vram_slots, shares, vram, grid, jobs=args.jobs)
        emit_json({"schema": SCHEMA, "command": command, "vram_slots": vram_slots, "vram_policy": dataclasses.asdict(vram),
                   "grid": grid, "traces": sorted(traces), "ranked": ranked}, args.out)
        return 0
    default = TierPolicy()  # exclusive after 32 steps in VRAM
    policies = {"first": FIRST_POLICY, "default": default, "shared": dataclasses.replace(default, exclusive=False),
                "exclusive-at-once": dataclasses.replace(default, exclusive_after=1), **dict(args.policy)}
    back = [] if args.no_write_back else ["default", "exclusive-at-once"]
    result = {"schema": SCHEMA, "command": command, "policies": {n: dataclasses.asdict(p) for n, p in policies.items()},
              "vram_policy": dataclasses.asdict(vram), "write_back": back,
              "traces": {name: simulate(trace, profile, vram_slots, shares, policies, vram, back) for name, trace in traces.items()}}
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
