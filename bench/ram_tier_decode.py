#!/usr/bin/env python3
"""Exact mode with host RAM for part of the experts (issue 32), against its bound and against full RAM.

``run_offload_checks.sh ram-tier`` runs bench.compare on one checkpoint with every expert in RAM (and stock-vram, for
the all-VRAM step time), then with RAM budgets of 50 % and 25 % of the experts (``--host-ram-gb``: the RAM tier's
window of one layer plus policy slots), and ``bench/disk_bw.py`` on the same disk. This script gives the budget for a
share (``--budget-gb``) and reports the runs (``--report``):

- decode tok/s at each budget, and its ratio to the bound ``1 / max(T_fix, M x B / W_link + D x B / W_disk)`` per
  token, where ``T_fix`` is stock-vram's step time (every expert in VRAM), ``M`` the experts a decode token reads
  from host memory (every VRAM miss: from the RAM tier or, after a disk read, from its window), ``D`` those read
  from disk first, ``B`` an expert's bytes, ``W_link`` the measured zero-copy rate, ``W_disk`` the faster of the
  O_DIRECT rate ``disk_bw`` measured in the same call at 4 reads in flight (a layer's disk misses are read together)
  and the rate the tier's own reads ran at in that arm (the faster gives the higher bound, the stricter ratio);
- prefill 4096 tok/s at each budget against full RAM, and against its own bound: the longer of full RAM's prefill and
  a staged forward's disk reads at ``W_disk`` (staging reads them a layer ahead, behind the compute);
- the host RSS peak against the budget plus the process's stated overhead (``cost_model.PROCESS_OVERHEAD``).

    python3 -m bench.ram_tier_decode --budget-gb CKPT 50          # prints GLM53_HOST_RAM_GB for 50 % of CKPT's experts
    python3 -m bench.ram_tier_decode --checkpoint CKPT_ROOT       # prints (writes if missing) bench.compare's checkpoint
    python3 -m bench.ram_tier_decode --report DIR [--out ram-tier.json]
    python3 -m bench.ram_tier_decode --policy-runs A.json B.json A2.json [--out ram-policy-ab.json]

``run_offload_checks.sh ram-policy-ab`` runs exact mode at 50 % RAM three times, the tier's default policy, the
policy of ``RAM_POLICY_OLD_ARGS`` (the ``GLM53_RAM_TIER_*`` settings' flags), the default again; ``--policy-runs``
puts their decode rates and reads side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.output import emit_json
from glm53 import cost_model as cm
from glm53.config import GB

SCHEMA = "glm53.ram_tier/1"
SHARES = (100, 50, 25)
PREFILL = "4096"


def budget_gb(ckpt: Path, share: float) -> float:
    """GLM53_HOST_RAM_GB for a RAM tier of ``share`` % of the checkpoint's expert blocks (at least one layer's)."""
    from glm53.offload.host_store import HostStore

    return budget_bytes(HostStore.scan(ckpt), share) / GB


def budget_bytes(store, share: float) -> int:
    """The host bytes for ``share`` % of the expert blocks of ``store`` (a ``HostStore``, or anything with its
    ``num_experts``, ``layout.block_bytes`` and ``arena_bytes``), at least one layer's and half a block."""
    layer = store.num_experts * store.layout.block_bytes
    return int(max(layer + store.layout.block_bytes // 2, share / 100 * store.arena_bytes))


def checkpoint(ckpt_root: Path, routing: str = "trained") -> Path:
    """The scaled checkpoint bench.compare measures on (written there, as it would, if it is not yet)."""
    from types import SimpleNamespace

    from bench.compare import prepare_checkpoint

    args = SimpleNamespace(ckpt=None, stats=None, preset="scaled", seed=1, moe_layers=None, calibrate_rounds=0,
                           routing=routing, ckpt_root=ckpt_root)
    return prepare_checkpoint(args)[0]


def _arm(path: Path, name: str) -> dict | None:
    if not path.exists():
        return None
    return next((a for a in json.loads(path.read_text())["arms"] if a["name"] == name and a.get("status") == "ok"), None)


def per_token(arm: dict) -> dict:
    """Experts a decode token read from host memory (VRAM misses) and from disk, from the arm's engine statistics."""
    off = arm["engine_stats"]["offload"]
    cache = off["cache"]
    steps = max(cache["decode_steps"], 1)
    tier = off.get("ram_tier")
    disk = tier["served"]["disk"] / steps if tier else 0.0
    return {"host_reads": cache["misses"] / steps, "disk_reads": disk, "decode_steps": cache["decode_steps"],
            "block_bytes": cache["slot_bytes"], "tier": tier}


def decode_layer_ms(tier: dict) -> dict | None:
    """A decode layer's host time on the tier's path, in ms (its stats: ``TieredHome`` and ``RamTier.step``): the wait
    for the routing (the sync), the policy's bookkeeping, pointing the tables while the disk reads, the wait for the
    reads left, re-pointing the tables (over all layers) and the rest of the tier's step; None from a run before these
    were counted."""
    layers, decode = tier.get("layers") or {}, tier.get("decode")
    n = layers.get("decode_layers")
    if not n or decode is None or "decode_wait_seconds" not in layers:
        return None
    per = lambda seconds: round(seconds / n * 1e3, 3)
    # disk_read: what the reads add to a layer's step. Since 2026-12-04 the policy runs while they are in flight and
    # wait_seconds is the rest of their time; before, they followed the policy and read_seconds was all of it
    disk = decode.get("wait_seconds", decode["read_seconds"])
    # placed: re-pointing the tables (the rehome) while the reads are in flight (since 2026-12-04; before, after them)
    placed = decode.get("placed_seconds", 0.0)
    rest = layers["decode_tier_seconds"] - decode["policy_seconds"] - placed - disk
    return {"sync_wait": per(layers["decode_wait_seconds"]), "policy": per(decode["policy_seconds"]),
            "placed_while_reading": per(placed), "disk_read": per(disk), "rest_of_step": per(rest),
            "rehome_all_layers": round(layers["rehome_seconds"] / (n + layers.get("other_layers", 0)) * 1e3, 3),
            "disk_read_gbs": decode.get("read_gbs")}


def report(run_dir: Path) -> dict:
    full = run_dir / "compare-ram-100.json"
    stock = _arm(full, "stock-vram")
    runs = [run_dir / f"compare-ram-{share}.json" for share in SHARES]
    disk_bw = run_dir / "disk-bw.json"  # absent: the tiers' own rates alone
    w_disk = json.loads(disk_bw.read_text())["gbs_by_reads_in_flight"]["o_direct"]["4"]["best_gbs"] * GB if disk_bw.exists() else 0.0
    bandwidth = json.loads(next(p for p in runs if p.exists()).read_text())["bandwidth"]
    w_link = bandwidth["pcie_zero_copy_read_gbs"] * GB
    t_fix = 1.0 / stock["decode_tok_s"] if stock else None
    rows, base = {}, None
    for share in SHARES:
        arm = _arm(run_dir / f"compare-ram-{share}.json", "exact")
        if arm is None:
            rows[str(share)] = {"status": "not run or failed"}
            continue
        counts = per_token(arm)
        b = counts["block_bytes"]
        served_gbs = (counts["tier"] or {}).get("disk_gbs", {}).get("serving") or 0.0
        w_disk_arm = max(w_disk, served_gbs * GB)
        io_s = counts["host_reads"] * b / w_link + counts["disk_reads"] * b / w_disk_arm
        bound_s = max(t_fix or 0.0, io_s)
        budget = None if share == 100 else arm["settings"].get("host_ram_gb")
        row = {
            "decode_tok_s": round(arm["decode_tok_s"], 2),
            "bound_tok_s": round(1.0 / bound_s, 2) if bound_s else None,
            "of_bound": round(arm["decode_tok_s"] * bound_s, 3) if bound_s else None,
            "prefill_tok_s": round(arm["prefill_tok_s"].get(PREFILL, 0.0), 1) or None,
            "host_reads_per_token": round(counts["host_reads"], 2),
            "disk_reads_per_token": round(counts["disk_reads"], 2),
            "w_disk_gbs": round(w_disk_arm / GB, 3),
            "host_rss_peak_gb": arm.get("host_rss_peak_gb"),
            "budget_gb": budget,
        }
        if budget is not None and arm.get("host_rss_peak_gb") is not None:
            allowed = budget + cm.PROCESS_OVERHEAD / GB
            row["rss_within_budget_plus_overhead"] = arm["host_rss_peak_gb"] <= allowed
            row["rss_allowed_gb"] = round(allowed, 2)
        if counts["tier"]:
            row["ram_tier"] = {k: counts["tier"][k] for k in ("policy_slots", "share_of_experts", "served", "disk_gbs", "read_seconds")}
            row["decode_layer_ms"] = decode_layer_ms(counts["tier"])
        if share == 100:
            base = row
        elif base:
            row["decode_vs_full_ram"] = round(row["decode_tok_s"] / base["decode_tok_s"], 3)
            if row["prefill_tok_s"] and base["prefill_tok_s"]:
                row["prefill_vs_full_ram"] = round(row["prefill_tok_s"] / base["prefill_tok_s"], 3)
                staging = arm["engine_stats"]["offload"].get("staging", {})
                if staging.get("forwards") and staging.get("disk_experts"):
                    # a staged forward reads its disk experts behind its compute: it takes the longer of the two
                    disk_s = staging["disk_experts"] / staging["forwards"] * b / w_disk_arm
                    bound = int(PREFILL) / max(int(PREFILL) / base["prefill_tok_s"], disk_s)
                    row.update(prefill_disk_s=round(disk_s, 2), prefill_bound_tok_s=round(bound, 1),
                               prefill_of_bound=round(row["prefill_tok_s"] / bound, 3))
        rows[str(share)] = row
    goals = {}
    half = rows.get("50", {})
    if "of_bound" in half:
        goals["decode_50_of_bound"] = {"value": half["of_bound"], "target": 0.85, "met": half["of_bound"] >= 0.85}
    if "prefill_vs_full_ram" in half:
        goals["prefill_50_vs_full"] = {"value": half["prefill_vs_full_ram"], "target": 0.7, "met": half["prefill_vs_full_ram"] >= 0.7}
    if "rss_within_budget_plus_overhead" in half:
        goals["rss_50"] = {"value": half["host_rss_peak_gb"], "target": half["rss_allowed_gb"], "met": half["rss_within_budget_plus_overhead"]}
    first = json.loads(next(p for p in runs if p.exists()).read_text())
    return {"schema": SCHEMA, "date": first.get("date"), "machine": first.get("machine"), "checkpoint": first.get("checkpoint"),
            "versions": first.get("versions"), "runs": [p.name for p in runs if p.exists()],
            "t_fix_ms": round(t_fix * 1000, 3) if t_fix else None, "w_link_gbs": round(w_link / GB, 2),
            "w_disk_gbs": round(w_disk / GB, 3), "by_ram_share": rows, "goals": goals}


def policy_runs(paths: list[Path]) -> dict:
    """The exact (or else the fast) arm of each bench.compare file (the A/B/A runs of ``ram-policy-ab``,
    ``ram-tier-ahead``, ``ram-tier-fast``): decode tok/s, the experts a token read from host memory and from disk, the
    tier's admissions per token and the policy it ran (``/stats``); in fast mode, what its CPU tier took."""
    rows = {}
    for path in paths:
        arm = _arm(path, "exact") or _arm(path, "fast")
        if arm is None or "ram_tier" not in arm["engine_stats"]["offload"]:
            rows[path.stem] = {"status": "not run, failed or without a RAM tier"}
            continue
        counts = per_token(arm)
        tier = counts["tier"]
        rows[path.stem] = {"arm": arm["name"], **_cpu_tier(arm["engine_stats"]["offload"], counts["decode_steps"]),
                           "decode_tok_s": round(arm["decode_tok_s"], 2), "disk_reads_per_token": round(counts["disk_reads"], 2),
                           "host_reads_per_token": round(counts["host_reads"], 2), "decode_steps": counts["decode_steps"],
                           "admissions_per_token": round(tier["served"]["admitted"] / max(counts["decode_steps"], 1), 2),
                           "read_ahead_per_token": round(tier["served"].get("ahead", 0) / max(counts["decode_steps"], 1), 2),
                           "read_ahead_used_per_token": round(tier["served"].get("ahead_used", 0) / max(counts["decode_steps"], 1), 2),
                           "written_back_per_token": round(tier["served"].get("written_back", 0) / max(counts["decode_steps"], 1), 2),
                           "decode_layer_ms": decode_layer_ms(tier), "disk_gbs": tier.get("disk_gbs"),
                           "settings": {k: v for k, v in arm["settings"].items() if k.startswith(("ram_tier", "disk_"))},
                           "policy": tier["policy"]}
    return {"schema": SCHEMA, "runs": rows}


def _cpu_tier(offload: dict, steps: int) -> dict:
    """Fast mode's CPU tier in a run (``/stats``' ``cpu_tier``): experts it computed a token, its state, the
    experts the RAM tier moved under it; or why it was off. Nothing for exact mode."""
    ct = offload.get("cpu_tier")
    if ct is None:
        return {}
    if "off" in ct:
        return {"cpu_tier": {"off": ct["off"]}}
    return {"cpu_tier": {"experts_per_token": round(ct["split"]["cpu_experts"] / max(steps, 1), 2), "state": ct.get("state"),
                         "fallback_jobs": ct.get("device", {}).get("fallback_jobs"), "repointed": ct.get("repointed")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-gb", nargs=2, metavar=("CKPT", "SHARE"), help="print GLM53_HOST_RAM_GB for SHARE %% of CKPT's experts")
    ap.add_argument("--report", type=Path, help="the ram-tier phase's directory")
    ap.add_argument("--checkpoint", type=Path, metavar="CKPT_ROOT", help="print bench.compare's `trained` scaled checkpoint there (written if missing)")
    ap.add_argument("--policy-runs", type=Path, nargs="+", metavar="COMPARE_JSON", help="the runs of ram-policy-ab, side by side")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.budget_gb:
        print(f"{budget_gb(Path(args.budget_gb[0]), float(args.budget_gb[1])):.6f}")
        return 0
    if args.checkpoint:
        print(checkpoint(args.checkpoint))
        return 0
    if args.policy_runs:
        emit_json(policy_runs(args.policy_runs), args.out)
        return 0
    if not args.report:
        ap.error("give --budget-gb, --checkpoint, --report or --policy-runs")
    result = report(args.report)
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
