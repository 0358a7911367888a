"""The chart of a ``bench/compare.py`` run: decode and prefill tok/s per arm, with the decode bounds drawn.

    python3 -m bench.chart bench/results/2026-11-29-h200.json [--out chart.png]

Left: decode tok/s per arm (the median over an arm's runs; a repeated arm shows its range as an error bar), with
the exact-mode bound (and the fast-mode upper bound) as horizontal lines. Right: prefill tok/s per arm, one bar
per prompt length. Arms that did not run are labelled with their status. Needs matplotlib (not a dependency of
the package: ``render`` raises ImportError without it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import scoreboard


def series(results: dict) -> dict:
    """What the chart draws, from the results alone: arms in run order with their medians and ranges."""
    names = []
    for arm in results.get("arms", []):
        if arm["name"] not in names:
            names.append(arm["name"])
    rows = []
    for name in names:
        runs = scoreboard.ok_runs(results, name)
        decode = [r["decode_tok_s"] for r in runs]
        status = "ok" if runs else next(a["status"] for a in results["arms"] if a["name"] == name)
        rows.append({
            "name": name, "status": status,
            "decode": scoreboard.arm_value(results, name, "decode_tok_s"),
            "decode_range": (min(decode), max(decode)) if len(decode) > 1 else None,
            "prefill": {n: scoreboard.arm_value(results, name, "prefill_tok_s", n) for n in _lengths(results)},
        })
    b = results.get("bounds") or {}
    lines = []
    if b.get("available"):
        lines.append((f"exact bound ({b['hit_rate']:.0%} hits)", b["exact"]["tok_s"]))
        if "fast" in b:
            lines.append((f"fast bound (CPU tier {b['fast']['cpu_tier_gbs']:.0f} GB/s)", b["fast"]["tok_s"]))
        elif "fast_dram" in b:
            lines.append(("fast upper bound (CPU at DRAM rate)", b["fast_dram"]["tok_s"]))
    return {"arms": rows, "bounds": lines}


def _lengths(results: dict) -> list[int]:
    return list((results.get("settings") or {}).get("prefill_lengths") or scoreboard.PREFILL_LENGTHS)


def render(results: dict, out: Path) -> Path:
    """Write the PNG. :raise ImportError: matplotlib is not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = series(results)
    arms = s["arms"]
    x = list(range(len(arms)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    decode = [a["decode"] or 0 for a in arms]
    err = [[(a["decode"] - a["decode_range"][0]) if a["decode_range"] else 0 for a in arms],
           [(a["decode_range"][1] - a["decode"]) if a["decode_range"] else 0 for a in arms]]
    bars = left.bar(x, decode, yerr=err, capsize=4, color="#4c72b0")
    for bar, a in zip(bars, arms):
        label = f"{a['decode']:.1f}" if a["decode"] is not None else a["status"]
        left.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    for (label, value), style in zip(s["bounds"], ("--", ":")):
        left.axhline(value, color="#c44e52", linestyle=style, label=f"{label}: {value:.1f}")
    left.set_xticks(x, [a["name"] for a in arms], rotation=20)
    left.set_ylabel("decode tok/s (1 stream)")
    left.set_title("decode")
    if s["bounds"]:
        left.legend(fontsize=8)
    lengths = _lengths(results)
    width = 0.8 / max(len(lengths), 1)
    for i, n in enumerate(lengths):
        values = [a["prefill"].get(n) or 0 for a in arms]
        bars = right.bar([p + (i - (len(lengths) - 1) / 2) * width for p in x], values, width, label=f"{n} tokens")
        for bar, value in zip(bars, values):
            if value:
                right.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=7)
    right.set_xticks(x, [a["name"] for a in arms], rotation=20)
    right.set_ylabel("prefill tok/s (time to first token)")
    right.set_title("prefill")
    right.legend(fontsize=8)
    m, c = results.get("machine", {}), results.get("checkpoint", {})
    fig.suptitle(f"{m.get('gpu')}: {c.get('preset')} checkpoint, {c.get('moe_layers')} MoE layers, "
                 f"{c.get('gpu_experts')}/{c.get('experts')} experts per layer in VRAM for the offload arms ({results.get('date', '')[:10]})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.chart", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="a results JSON of bench/compare.py")
    ap.add_argument("--out", type=Path, help="the PNG (default: the results path with .png)")
    args = ap.parse_args(argv)
    out = args.out or args.results.with_suffix(".png")
    render(json.loads(args.results.read_text()), out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
