"""The cost model (``glm53.cost_model``) replayed against every recorded run in ``bench/results/``: for each arm, the
decode rate it predicts from the run's own inputs, set against the rate measured (measured / predicted).

Inputs, per run, as recorded:
- the step's fixed part: the all-VRAM step (``stock-vram``'s decode, at each stream count) of the same file, else the
  median over the files of the same GPU and checkpoint (``bench.link_sweep``: its full-link exact run less its misses);
- the link: the emulated rate (``link_emulation``), else the measured zero-copy read rate (runs under the old SM-reader
  or copy-engine limiters use their target and are expected outliers: the SM reader slowed the GPU itself);
- misses: the arm's decode hit rate (``top_k x (1 - hit rate)`` distinct misses a layer at one stream), spread to n
  streams by the routing profile (the real model's first layers at the checkpoint's share of VRAM);
- fast mode: the CPU tier's figures and the misses it took, per decode phase where the run recorded them
  (``decode_phases``, since 2026-12-02), else at the end of the arm (its ``/stats``: the last phase's, an explained
  outlier for the earlier phases); a tier that took under 5 % of the misses rested: predicted as exact mode;
- ``bench.link_sweep``: each run's misses a step, its link rate and its tier's figures.

    python3 -m bench.predict [--results bench/results] [--write-band] [--out predict.json]

``--write-band`` records the share within 10 % and the error's median and 90th percentile where ``glm53 plan`` shows
them (``glm53/cost_model_error.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from bench import scoreboard
from bench.output import emit_json
from glm53 import cost_model as cm

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TIER_TOOK_PART = 0.05  # a fast arm whose tier took less of the misses than this rested
HOOK_GPU_S = 60e-6  # the tier's hooks on the GPU's clock a layer it takes part in, where a run did not record it
WITHIN = 0.10


def _key(doc: Mapping) -> tuple:
    """The GPU and checkpoint a run's fixed part belongs to."""
    c = doc.get("checkpoint") or {}
    return ((doc.get("machine") or {}).get("gpu"), c.get("preset"), c.get("seed"), c.get("moe_layers"), c.get("experts"))


def _costs(stats: Mapping | None, link_s: float) -> cm.Costs | None:
    """The CPU tier's figures an arm ended with (its ``/stats``), at the run's link."""
    tier = (scoreboard.find_stats(stats, ("cpu_tier",)) or {}).get("cpu_tier") or {}
    c = tier.get("costs")
    if not c:
        return None
    return cm.Costs({int(t): v * 1e-6 for t, v in c["cpu_expert_us"].items()}, handoff_s=c["handoff_us"] * 1e-6, link_expert_s=link_s,
                    vram_expert_s=c["vram_expert_us"] * 1e-6, cpu_job_s={int(t): v * 1e-6 for t, v in (c.get("cpu_job_us") or {}).items()},
                    gpu_fixed_s=(c.get("gpu_fixed_us") or 0.0) * 1e-6)


def _tier_share(stats: Mapping | None) -> tuple[float | None, float]:
    tier = (scoreboard.find_stats(stats, ("cpu_tier",)) or {}).get("cpu_tier") or {}
    split = tier.get("split") or {}
    hook = ((tier.get("worth") or {}).get("hooks_gpu_us_per_layer") or HOOK_GPU_S * 1e6) * 1e-6
    return (split["cpu_experts"] / split["misses"] if split.get("misses") else None), hook


class Replay:
    """The runs of a results directory and what the model needs across them."""

    def __init__(self, directory: Path, profile):
        self.docs: list[tuple[str, dict]] = []
        for path in sorted(Path(directory).glob("*.json")):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(doc, dict) and (doc.get("schema") == scoreboard.SCHEMA or "engines" in doc):
                self.docs.append((path.name, doc))
        self.profile = profile
        self.fixed = self._fixed_parts()

    def _fixed_parts(self) -> dict[tuple, dict[int, float]]:
        """Per GPU and checkpoint, the median all-VRAM step at each stream count."""
        seen: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
        for _, doc in self.docs:
            if doc.get("schema") != scoreboard.SCHEMA:
                continue
            for arm in scoreboard.ok_runs(doc, "stock-vram"):
                seen[_key(doc)][1].append(1.0 / arm["decode_tok_s"])
                for n, rate in (arm.get("decode_streams_tok_s") or {}).items():
                    seen[_key(doc)][int(n)].append(int(n) / rate)
        return {k: {n: statistics.median(v) for n, v in by.items()} for k, by in seen.items()}

    def misses(self, layers: int, slots: int, top_k: int, streams: int, hit: float) -> tuple[float, float]:
        """(missed, resident) distinct experts a layer at ``streams``, from the arm's one-token hit rate spread by the
        profile's overlap between tokens."""
        profile = self.profile[:layers]
        one, _ = cm.distinct_misses(profile, slots, top_k, 1)
        many, resident = cm.distinct_misses(profile, slots, top_k, streams)
        missed = top_k * (1 - hit) * many / one
        return missed, max(0.0, top_k * streams - missed) if streams == 1 else resident

    def compare_rows(self, name: str, doc: dict) -> list[dict]:
        ckpt, bw = doc["checkpoint"], doc.get("bandwidth") or {}
        emulated = scoreboard.emulated_link_gbs(doc)
        limited = (doc.get("link_limiter") or {}).get("target_read_gbs")
        link = emulated or limited or bw.get("pcie_zero_copy_read_gbs")
        B, L, top_k = ckpt.get("expert_bytes"), ckpt.get("moe_layers"), ckpt.get("top_k")
        condition = (f"emulated {emulated:g} GB/s" if emulated else f"SM/copy limiter at {limited:g} GB/s" if limited else "full link") + \
            (", CPU hog" if doc.get("cpu_hog") else "")
        rows = []
        in_file = {1: 1.0 / a["decode_tok_s"] for a in scoreboard.ok_runs(doc, "stock-vram")[:1]}
        for arm in (a for a in doc.get("arms", []) if a.get("status") == "ok" and a["name"] in scoreboard.PROJECT_ARMS):
            measured = {1: arm["decode_tok_s"], **{int(n): v for n, v in (arm.get("decode_streams_tok_s") or {}).items()}}
            for n, rate in measured.items():
                fixed = in_file.get(n) if n == 1 and in_file else self.fixed.get(_key(doc), {}).get(n)
                row = {"file": name, "arm": arm["name"], "streams": n, "condition": condition, "measured_tok_s": round(rate, 2)}
                recorded = (arm.get("decode_phases") or {}).get(str(n))
                hit = (recorded or {}).get("hit_rate")
                hit = arm.get("hit_rate") if hit is None else hit
                if not (fixed and link and B and L and hit is not None):
                    rows.append({**row, "predicted_tok_s": None, "note": "no all-VRAM step for this GPU and checkpoint" if not fixed
                                 else "inputs missing"})
                    continue
                missed, hits = self.misses(L, ckpt.get("gpu_experts") or 32, top_k, n, hit)
                step = cm.Step(fixed_s=fixed, moe_layers=L, misses=missed, hits=hits, tokens=n)
                link_s = B / (link * 1e9)
                phase_arm = {**arm, "engine_stats": recorded} if recorded and "cpu_tier" in recorded else arm
                seconds, note = self._arm_seconds(phase_arm, step, link_s)
                if arm["name"] == "fast" and recorded is None:
                    note += "; the tier's figures are the arm's last phase's"
                row.update(predicted_tok_s=round(n / seconds, 2), ratio=round(rate * seconds / n, 3), note=note.strip("; "))
                if limited:  # not an error of the model's: the measurement's conditions were not the link it names
                    row["excluded"] = "the old SM-reader and copy-engine limiters were no valid slower link (the SM reader slowed the GPU itself)"
                rows.append(row)
        return rows

    @staticmethod
    def _arm_seconds(arm: Mapping, step: cm.Step, link_s: float) -> tuple[float, str]:
        exact = cm.Costs({1: 1.0}, 0.0, link_s, 0.0)
        if arm["name"] != "fast":
            return cm.exact_step_s(step, exact), "prefetch not modelled (as exact)" if "prefetch" in arm["name"] or "oracle" in arm["name"] else ""
        costs = _costs(arm.get("engine_stats"), link_s)
        share, hook = _tier_share(arm.get("engine_stats"))
        if costs is None or share is None or share < TIER_TOOK_PART:
            return cm.exact_step_s(step, exact), "the tier rested (as exact)"
        seconds, k = cm.fast_step_s(step, costs, hook)
        return min(seconds, cm.exact_step_s(step, exact)), f"the split sends {k:.1f} a layer"

    def sweep_rows(self, name: str, doc: dict) -> list[dict]:
        """``bench.link_sweep``: every exact run but the one the fixed part comes from, and every fast run."""
        exact = doc["engines"].get("exact") or {}
        B = exact.get("block_bytes") or (doc["engines"].get("fast") or {}).get("block_bytes")
        measured = ((exact.get("link") or {}).get("measured") or {}).get("zero_copy_gbs")
        full = (exact.get("runs") or {}).get("full")
        layers = exact.get("moe_layers") or _layers(doc)
        if not (full and measured and B and layers):
            return []
        fixed = 1e-3 * full["ms_per_step"] - full["misses_per_step"] * B / (measured * 1e9)
        rows = []
        for mode, engine in doc["engines"].items():
            for run_name, run in engine["runs"].items():
                if mode == "exact" and run_name == "full":
                    continue
                gbs = run["link_gbs"] or measured
                link_s = B / (gbs * 1e9)
                m = run["misses_per_step"] / layers
                step = cm.Step(fixed_s=fixed, moe_layers=layers, misses=m, hits=8 - m)
                if mode == "exact":
                    seconds, note = cm.exact_step_s(step, cm.Costs({1: 1.0}, 0.0, link_s, 0.0)), ""
                else:
                    stats = {"cpu_tier": {"costs": run["costs"], "split": run["split"], "worth": run["worth"]}}
                    seconds, note = self._arm_seconds({"name": "fast", "engine_stats": stats}, step, link_s)
                rows.append({"file": name, "arm": mode, "streams": 1, "condition": f"link_sweep at {run_name}",
                             "measured_tok_s": run["decode_tok_s"], "predicted_tok_s": round(1 / seconds, 2),
                             "ratio": round(run["decode_tok_s"] * seconds, 3), "note": note})
        return rows

    def rows(self) -> list[dict]:
        out = []
        for name, doc in self.docs:
            out += self.compare_rows(name, doc) if doc.get("schema") == scoreboard.SCHEMA else self.sweep_rows(name, doc)
        return out


def _layers(doc: Mapping) -> int | None:
    """The MoE layers of a link sweep run before it recorded them (2026-12-02): its checkpoint's name holds the preset,
    and only the scaled one (12) was swept."""
    return 12 if "scaled" in str(doc.get("checkpoint", "")) else None


def summary(rows: list[dict]) -> dict:
    """The error over the rows the model is judged on (not the excluded ones)."""
    errors = [abs(r["ratio"] - 1) for r in rows if r.get("ratio") is not None and not r.get("excluded")]
    excluded = sum(1 for r in rows if r.get("excluded"))
    if not errors:
        return {"arms": 0, "excluded": excluded}
    ordered = sorted(errors)
    return {"arms": len(errors), "within_10pct": sum(e <= WITHIN for e in errors), "share_within_10pct": round(sum(e <= WITHIN for e in errors) / len(errors), 3),
            "median_abs_error": round(statistics.median(errors), 4), "p90_abs_error": round(ordered[int(0.9 * (len(ordered) - 1))], 4),
            "excluded": excluded}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.predict", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS, help="the results directory (default bench/results)")
    ap.add_argument("--out", type=Path, help="write every row and the summary as JSON here")
    ap.add_argument("--write-band", action="store_true", help=f"record the summary as the model's error band ({cm.ERROR_BAND.name})")
    args = ap.parse_args(argv)
    replay = Replay(args.results, cm.load_profile(cm.PROFILE))
    rows = replay.rows()
    result = {"summary": summary(rows), "rows": rows}
    if args.out:
        emit_json(result, args.out)
    print("| file | arm | streams | condition | measured | predicted | measured / predicted | note |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        pred = "—" if r["predicted_tok_s"] is None else f"{r['predicted_tok_s']:.1f}"
        ratio = "—" if r.get("ratio") is None else f"{r['ratio']:.2f}" + (" (excluded)" if r.get("excluded") else "" if abs(r["ratio"] - 1) <= WITHIN else " (outlier)")
        print(f"| {r['file']} | {r['arm']} | {r['streams']} | {r['condition']} | {r['measured_tok_s']:.1f} | {pred} | {ratio} | {r.get('note', '')} |")
    s = result["summary"]
    print(f"\n{s.get('within_10pct', 0)} of {s['arms']} arms within ±10 % (median error {s.get('median_abs_error')}, 90th percentile "
          f"{s.get('p90_abs_error')}); {s['excluded']} excluded (no valid link emulation)", file=sys.stderr)
    if args.write_band:
        cm.ERROR_BAND.write_text(json.dumps({**s, "command": "python3 -m bench.predict --write-band"}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
