"""Replacement policies of the GPU expert cache, replayed on a routing trace on the CPU, against the ideal.

The device kernel (``native/ec/expert_cache.cu``) runs the policy that ``glm53/offload/cache_policy.py`` defines: a
decayed pick frequency with admission past a hysteresis. This replays that definition next to the obvious
alternatives on the same trace, all with the same per-layer slot counts (the profile placement of
``cache_policy.placement``):

- ``static``: the warm start alone, never changed (the best fixed placement if the profile is the truth);
- ``static_hindsight``: the best fixed placement for the trace itself (each layer's most picked experts, the same
  slots per layer), which knows the whole trace;
- ``lru`` and ``clock``: admit every miss, evict the least recently used / the CLOCK hand's pick;
- ``decayed``: the kernel's policy, ``cache_policy.ReferenceCache`` (a slow and a fast decayed pick count, the fast
  one weighted by the layer's measured reuse over popularity's; admit a missed expert when its score beats the
  weakest resident not picked in this step by ``hysteresis``, at most ``max_admit`` per layer and step);
- ``belady``: the offline optimum with bypass (on a miss, keep whichever of the missed expert and the residents is
  used again last out), the ceiling any online policy can reach; ``belady_no_bypass``: the same but every miss is
  admitted (evicting the resident not in the step used again last), as the kernel's admissions are;
- ``static_true`` (generated traces: ``twin``, ``iid``): each layer's most likely experts by the routing's true
  pick probabilities. On i.i.d. picks no online policy beats it on average (``online_bound``), so each policy is
  reported as a share of Belady (``of_belady``) and of that bound (``of_online_bound``).

Link traffic: an admitted expert is copied into its slot before its layer's experts run, which then read it from
VRAM, so an admission replaces that step's read of the expert over the link (``ec_copy_kernel`` runs between
``ec_step_kernel`` and the layer, on the same stream). The experts read over the link per layer step are the
distinct misses, whatever is admitted: ``link_experts_per_layer_step`` is ``(1 - hit rate) * top_k`` for the
decayed policy, each one expert's bytes.

Traces: ``iid`` draws each step's top-k per layer from the profile's shares (no temporal structure); ``drift``
multiplies the shares by a slowly varying random factor per expert (topics change over a conversation), which is
where adaptive policies can beat the static placement; ``twin`` is the routing twin of the full synthetic checkpoint
(``bench.routing_stats``) of ``--routing`` ``random`` or ``trained`` (picks recurring over tokens as a trained
model's do), the profile then being the shares its router was fitted to. A recorded trace can be replayed with
``--trace`` (``.npy`` int [steps, layers, top_k]); for one the engine recorded on a ``glm53 synth`` checkpoint,
``--synth-preset`` places and warm-starts from the profile that checkpoint ships, as the engine did.

    python3 -m bench.cache_policy_sim [--share 0.11] [--steps 2000] [--mode iid|drift|twin] [--routing trained] [--out sim.json]
    python3 -m bench.cache_policy_sim --trace engine.npy --synth-preset scaled --slots 384
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from glm53.offload.cache import Policy
from glm53.offload.cache_policy import C_ADMITS, C_HITS, ReferenceCache, placement, popularity_lift, shares, warm_scores

PROFILE = REPO / "glm53" / "models" / "glm53-flash-routing-profile.json"


def load_profile(path: Path) -> np.ndarray:
    data = json.loads(Path(path).read_text())
    keys = sorted(data, key=lambda k: int(k.split("layers.")[1].split(".")[0]))
    return np.array([data[k] for k in keys], dtype=np.float64)


def synth_profile(preset: str, moe_layers: int | None = None) -> np.ndarray:
    """float [MoE layers, experts]: the routing profile a ``glm53 synth --preset PRESET`` checkpoint ships with, in
    MoE layer order, what the engine places and warm-starts its cache by on that checkpoint (it does not depend on
    the checkpoint's seed)."""
    from glm53.tools.synth import presets, router, writer

    shape, data = presets.resolve(preset, moe_layers), router.load_profile(writer.DEFAULT_PROFILE)
    counts = writer.shipped_profile(shape, writer.router_targets(shape, data), data)
    return np.array([counts[router.profile_key(i)] for i in shape.moe_layer_indices], dtype=np.float64)


def make_trace(profile: np.ndarray, steps: int, top_k: int, mode: str, seed: int) -> np.ndarray:
    """int [steps, layers, top_k]: distinct experts per layer and step, drawn by the shares (Gumbel top-k)."""
    rng = np.random.default_rng(seed)
    layers, experts = profile.shape
    logp = np.log(np.maximum(shares(profile), 1e-12))
    walk = np.zeros((layers, experts))
    trace = np.empty((steps, layers, top_k), dtype=np.int64)
    for t in range(steps):
        if mode == "drift":
            walk = 0.995 * walk + rng.normal(0.0, 0.1, size=walk.shape)  # ~200-step memory, log-factor sd ~1
        gumbel = rng.gumbel(size=(layers, experts))
        trace[t] = np.argpartition(-(logp + walk + gumbel), top_k, axis=1)[:, :top_k]
    return trace


def starting_residents(profile: np.ndarray, slots: int) -> list[list[int]]:
    """Per layer, the experts the cache starts with (its quota is their number)."""
    start = [[] for _ in range(profile.shape[0])]
    for layer, expert in placement(profile, slots):
        start[layer].append(expert)
    return start


def run_static(trace, start):
    hits = 0
    for layer, resident in enumerate(start):
        members = set(resident)
        hits += sum(int(e) in members for e in trace[:, layer].reshape(-1))
    return hits


def run_static_hindsight(trace, start):
    hits = 0
    for layer, resident in enumerate(start):
        counts = np.bincount(trace[:, layer].reshape(-1), minlength=1)
        hits += int(np.sort(counts)[::-1][: len(resident)].sum())
    return hits


def run_static_by(trace, start, probabilities: np.ndarray):
    """Static, each layer's slots (as many as ``start`` gives it) holding its most likely experts by
    ``probabilities`` (float [layers, experts], each expert's chance to be picked in a step; ties to the lower id)."""
    best = [[int(e) for e in np.argsort(-probabilities[layer], kind="stable")[: len(resident)]] for layer, resident in enumerate(start)]
    return run_static(trace, best)


def expected_static_hit_rate(start, probabilities: np.ndarray, top_k: int) -> float:
    """The hit rate ``run_static_by`` has on average over traces of ``probabilities``: per step, the chances of each
    layer's most likely experts (as many as ``start`` gives it), over the ``top_k`` picks of every layer."""
    top = sum(float(np.sort(probabilities[layer])[::-1][: len(resident)].sum()) for layer, resident in enumerate(start))
    return top / (len(start) * top_k)


def run_lru(trace, start):
    hits = 0
    for layer, resident in enumerate(start):
        if not resident:
            continue
        order = OrderedDict((e, None) for e in resident)  # least recently used first
        for t in range(trace.shape[0]):
            for e in trace[t, layer]:
                e = int(e)
                if e in order:
                    hits += 1
                    order.move_to_end(e)
                else:
                    order.popitem(last=False)
                    order[e] = None
    return hits


def run_lfu(trace, start):
    """Admit every miss, evict the resident picked least often since the replay began (ties: the lower id)."""
    hits = 0
    for layer, resident in enumerate(start):
        if not resident:
            continue
        count = {}
        members = set(resident)
        for t in range(trace.shape[0]):
            step = [int(e) for e in trace[t, layer]]
            for e in step:
                count[e] = count.get(e, 0) + 1
            for e in step:
                if e in members:
                    hits += 1
                else:  # an expert of this step is never the victim, as in the kernel's policy
                    victim = min((c for c in members if c not in step), key=lambda c: (count.get(c, 0), c))
                    members.remove(victim)
                    members.add(e)
    return hits


def run_clock(trace, start):
    hits = 0
    for layer, resident in enumerate(start):
        slots = list(resident)
        ref = [False] * len(slots)
        where = {e: i for i, e in enumerate(slots)}
        hand = 0
        for t in range(trace.shape[0]):
            for e in trace[t, layer]:
                e = int(e)
                if e in where:
                    hits += 1
                    ref[where[e]] = True
                elif slots:
                    while ref[hand]:
                        ref[hand] = False
                        hand = (hand + 1) % len(slots)
                    del where[slots[hand]]
                    slots[hand], ref[hand] = e, True
                    where[e] = hand
                    hand = (hand + 1) % len(slots)
    return hits


def replay_decayed(trace, start, profile: np.ndarray, policy: Policy) -> ReferenceCache:
    """The kernel's policy, the reference of ``ec_step_kernel``, step by step from the warm scores of ``profile``;
    the cache after the replay (its counters)."""
    residents = [(layer, expert) for layer, experts in enumerate(start) for expert in experts]
    top_k = trace.shape[2]
    cache = ReferenceCache(warm_scores(profile, top_k, policy.decay, policy.warm_horizon), residents,
                           warm_scores(profile, top_k, policy.recency_decay, policy.warm_horizon), popularity_lift(profile, top_k))
    for t in range(trace.shape[0]):
        for layer in range(trace.shape[1]):
            cache.step(layer, trace[t, layer], policy.decay, policy.hysteresis, policy.max_admit, policy.recency)
    return cache


def run_decayed(trace, start, profile: np.ndarray, policy: Policy):
    return int(replay_decayed(trace, start, profile, policy).counters[:, C_HITS].sum())


def run_belady(trace, start, bypass: bool = True, hit: np.ndarray | None = None):
    """Offline optimum per layer with its quota: with bypass, or admitting every miss (the step's own experts stay).

    :param hit: bool [steps, layers, top_k] set True where a pick hits (None: only count).
    """
    hits = 0
    steps = trace.shape[0]
    for layer, resident in enumerate(start):
        q = len(resident)
        seq = trace[:, layer]
        # next use after step t of every expert, scanning backwards
        nxt = {}
        next_use = np.empty(seq.shape, dtype=np.int64)
        for t in range(steps - 1, -1, -1):
            for j, e in enumerate(seq[t]):
                next_use[t, j] = nxt.get(int(e), steps + 1)
            for e in seq[t]:
                nxt[int(e)] = t
        first = dict(nxt)  # first use of each expert
        res = {e: first.get(e, steps + 1) for e in resident}  # expert -> its next use
        for t in range(steps):
            step = {int(e) for e in seq[t]}
            for j, e in enumerate(seq[t]):
                e = int(e)
                if e in res:
                    hits += 1
                    res[e] = int(next_use[t, j])
                    if hit is not None:
                        hit[t, layer, j] = True
                elif q:
                    others = list(res) if bypass else [x for x in res if x not in step]
                    far = max(others, key=res.get, default=None)
                    if far is not None and (not bypass or res[far] > next_use[t, j]):
                        del res[far]
                        res[e] = int(next_use[t, j])
    return hits


POLICIES = ("static", "static_hindsight", "lru", "clock", "decayed", "belady", "belady_no_bypass")


def online_bound(hit_rate: dict, iid: bool, expected: float | None = None) -> dict:
    """The best hit rate an online policy can be held to on this trace, beside Belady's (which knows the future).

    With the cache's slots partitioned between layers (each layer's ``len(start[layer])``), a step's hits are the
    picks of the experts resident when the step begins, chosen from the past alone. When the picks are independent
    of the past, with each expert picked in a step with probability ``p`` (i.i.d. routing: the ``random`` twin,
    ``--mode iid``), the expected hits of a step are the sum of ``p`` over the residents, at most that of each
    layer's ``q`` most likely experts. So no online policy's expected hit rate beats the static set chosen by the
    true ``p`` (``static_true``), whose hit rate on the trace estimates it without bias (a policy may beat it on
    a finite trace by chance, by about the trace's noise). ``static_hindsight``, the best static set for the trace
    itself, is at least ``static_true`` on it: an upper estimate when ``p`` is not known. With slots moved between
    layers the bound would be the global top of ``p``; the cache does not move them.

    Where the picks depend on the past (a trained router's recur over tokens; ``drift``; the real engine's), an
    online policy can beat every static set (the ``trained`` twin: 0.59 against 0.39), and Belady is the only
    ceiling; the static figure is then only a reference, the best fixed placement.

    :param hit_rate: ``simulate``'s hit rates, with ``static_true`` when the true probabilities are known.
    :param iid: the trace's picks are independent over steps, so the figure is a bound.
    :param expected: ``static_true``'s expected hit rate (``expected_static_hit_rate``), the bound itself.
    """
    name = "static_true" if "static_true" in hit_rate else "static_hindsight"
    return {"policy": name, "hit_rate": hit_rate[name], "is_bound": bool(iid),
            "of_belady": round(hit_rate[name] / hit_rate["belady"], 3), **({"expected": expected} if expected is not None else {})}


def simulate(profile: np.ndarray, trace: np.ndarray, slots: int, policy: Policy | None = None,
             probabilities: np.ndarray | None = None, iid: bool = False) -> dict:
    """Every policy's hit rate, each as a share of Belady's and of the online bound (``online_bound``); the decayed
    policy's admissions per layer and step (each one expert over the link).

    :param probabilities: float [layers, experts] each expert's true chance to be picked in a step (the routing that
        generated the trace), for ``static_true``; None: not known.
    :param iid: the picks are independent over steps (``online_bound`` is then a bound, else a reference).
    """
    policy = policy or Policy()
    start = starting_residents(profile, slots)
    picks = trace.shape[0] * trace.shape[2] * trace.shape[1]
    decayed = replay_decayed(trace, start, profile, policy).counters
    runs = {
        "static": lambda: run_static(trace, start),
        "static_hindsight": lambda: run_static_hindsight(trace, start),
        "lru": lambda: run_lru(trace, start),
        "clock": lambda: run_clock(trace, start),
        "decayed": lambda: int(decayed[:, C_HITS].sum()),
        "belady": lambda: run_belady(trace, start),
        "belady_no_bypass": lambda: run_belady(trace, start, bypass=False),
    }
    if probabilities is not None:
        runs["static_true"] = lambda: run_static_by(trace, start, probabilities)
    hit_rate = {name: round(runs[name]() / picks, 4) for name in runs}
    expected = None if probabilities is None else round(expected_static_hit_rate(start, probabilities, trace.shape[2]), 4)
    bound = online_bound(hit_rate, iid, expected)
    layer_steps = trace.shape[0] * trace.shape[1]
    fields = ("decay", "hysteresis", "max_admit", "recency_decay", "recency_weight", "recency_keep", "warm_horizon")
    return {"picks": picks, "slots": slots, "policy": {name: getattr(policy, name) for name in fields},
            "hit_rate": hit_rate, "of_belady": {name: round(hit_rate[name] / hit_rate["belady"], 3) for name in runs},
            "online_bound": bound, "of_online_bound": {name: round(hit_rate[name] / bound["hit_rate"], 3) for name in runs},
            "admits_per_layer_step": round(float(decayed[:, C_ADMITS].sum()) / layer_steps, 3),
            "link_experts_per_layer_step": round((picks - int(decayed[:, C_HITS].sum())) / layer_steps, 3)}


def twin_trace(routing: str, steps: int, seed: int, samples: int = 50_000) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(profile float [42, 288] the twin's target shares, picks int [steps, 42, 8], the twin's true pick
    probabilities float [42, 288] from ``samples`` independent tokens) of the full checkpoint's twin."""
    from bench.routing_stats import twin_from_settings

    twin, shares = twin_from_settings("full", routing, seed, None)
    return shares, twin.run(steps, seed).picks, pick_probabilities(twin, samples, seed)


def pick_probabilities(twin, samples: int, seed: int) -> np.ndarray:
    """float [layers, experts]: each expert's chance to be picked in a step by the twin's routing at its stationary
    law (every routing state ``N(0, I)``; for ``random`` the logits themselves ``N(0, sigma^2)``), estimated from
    ``samples`` tokens drawn apart from any trace (standard error ``sqrt(p (1 - p) / samples)``: 0.0008 at
    ``p`` 0.03 and 50,000 samples), so choosing by it does not fit the trace."""
    from glm53.tools.synth.routing import top_picks

    rng = np.random.default_rng([seed, 33])
    out = np.zeros((len(twin.layers), twin.experts))
    for i in range(len(twin.layers)):
        if twin.dynamics is None:
            logits = twin.sigma * rng.standard_normal((samples, twin.experts), dtype=np.float32)
        else:
            states = rng.standard_normal((samples, twin.dynamics.rank), dtype=np.float32)
            logits = states @ (np.float32(twin.sigma) * twin.directions[i]).T
        out[i] = np.bincount(top_picks(logits, twin.biases[i], twin.top_k).reshape(-1), minlength=twin.experts) / samples
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.cache_policy_sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, default=PROFILE)
    ap.add_argument("--share", type=float, default=1376 / 12096, help="cached share of all experts (default: a 24 GB card's, 1376 of 12096)")
    ap.add_argument("--slots", type=int, help="cached experts in all (instead of --share), as the engine's --ec-cache-experts")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--mode", choices=("iid", "drift", "twin"), default="iid")
    ap.add_argument("--routing", choices=("random", "trained"), default="trained", help="the twin's routing (--mode twin)")
    ap.add_argument("--decay", type=float, default=Policy.decay)
    ap.add_argument("--hysteresis", type=float, default=Policy.hysteresis)
    ap.add_argument("--max-admit", type=int, default=Policy.max_admit)
    ap.add_argument("--recency-decay", type=float, default=Policy.recency_decay)
    ap.add_argument("--recency-weight", type=float, default=Policy.recency_weight)
    ap.add_argument("--recency-keep", type=float, default=Policy.recency_keep)
    ap.add_argument("--warm-horizon", type=float, default=Policy.warm_horizon, help="decode steps the warm start counts the profile as at most")
    ap.add_argument("--trace", type=Path, help="replay this recorded trace (.npy int [steps, layers, top_k]) instead")
    ap.add_argument("--synth-preset", help="with --trace: the profile is the one a glm53 synth checkpoint of this preset ships")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.synth_preset and not args.trace:
        ap.error("--synth-preset goes with --trace")
    profile = synth_profile(args.synth_preset) if args.synth_preset else load_profile(args.profile)
    probabilities = None  # known for the generated traces: the static set they give bounds online policies on i.i.d. picks
    if args.trace:
        trace = np.load(args.trace)
        if trace.ndim != 3 or trace.shape[1] != profile.shape[0]:
            ap.error(f"--trace {args.trace}: shape {trace.shape}, expected [steps, {profile.shape[0]} layers, top_k] for the profile")
    elif args.mode == "twin":
        profile, trace, probabilities = twin_trace(args.routing, args.steps, args.seed)
    else:
        trace = make_trace(profile, args.steps, args.top_k, args.mode, args.seed)
        probabilities = shares(profile) if args.mode == "iid" else None  # Gumbel top-k: more likely with a larger share
    slots = args.slots if args.slots is not None else round(args.share * profile.size)
    policy = Policy(decay=args.decay, hysteresis=args.hysteresis, max_admit=args.max_admit, recency_decay=args.recency_decay,
                    recency_weight=args.recency_weight, recency_keep=args.recency_keep, warm_horizon=args.warm_horizon)
    iid = not args.trace and (args.mode == "iid" or (args.mode == "twin" and args.routing == "random"))
    result = {"profile": f"glm53 synth --preset {args.synth_preset}" if args.synth_preset else str(args.profile), "mode": "trace" if args.trace else args.mode, "steps": int(trace.shape[0]),
              "seed": args.seed, **({"routing": args.routing} if args.mode == "twin" and not args.trace else {}),
              **simulate(profile, trace, slots, policy, probabilities, iid)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
