"""A ``bench.compare`` run on a checkpoint of few MoE layers, extrapolated to more, and, given a run at that size,
set against it (issue 22: where was the 12-layer extrapolation wrong?).

The model is the one every earlier estimate used (``../shared/notes/synthetic-checkpoint.md``), per arm and phase
(``glm53.cost_model.more_layers_s``):
- all in VRAM (``stock-vram``), the time of a token or a prompt grows with the layer count: ``t_v(L) = t_v(L0) x
  (D + L) / (D + L0)``, with ``D`` the dense layers before the MoE ones (3 in GLM-5.3-Flash). The head's and the
  embedding's share is counted as if it grew with them (a small overestimate).
- an offload arm adds a fixed time per MoE layer, measured against ``stock-vram`` at ``L0``: ``t(L) = t_v(L) + L x
  (t(L0) - t_v(L0)) / L0`` (its experts' misses, staging, the CPU tier's share: all per layer).
- host RSS grows by the routed experts of the added layers (one copy: ``experts x expert_bytes`` a layer) for every
  arm that holds them in host RAM (all but ``stock-vram``; ``stock-mcs-pa`` holds two copies, counted twice).

Decode is a token's time (one stream); prefill a prompt's time at each measured length. A figure the base run does not
have (an arm that failed, ``stock-vram`` missing) is not extrapolated. With ``--measured``, each predicted figure
is set against the run at the target size (measured / predicted).

    python3 -m bench.extrapolate --base bench/results/2026-11-29-h200.json --moe-layers 42 [--measured RUN.json] [--out F]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.output import emit_json
from glm53 import cost_model as cm
from bench.scoreboard import arm_value

DENSE_LAYERS = 3  # GLM-5.3-Flash's dense layers before its MoE ones (the synthetic presets keep them)
HOST_COPIES = {"stock-vram": 0, "stock-mcs-pa": 2}  # copies of the routed experts an arm keeps in host RAM (others: 1)


def _moe_layers(results: Mapping) -> int:
    layers = (results.get("checkpoint") or {}).get("moe_layers")
    if not isinstance(layers, int) or layers < 1:
        raise ValueError("the results do not say their checkpoint's MoE layer count (checkpoint.moe_layers)")
    return layers


def _arms(results: Mapping) -> list[str]:
    seen: list[str] = []
    for arm in results.get("arms", []):
        if arm.get("name") not in seen:
            seen.append(arm["name"])
    return seen


def _seconds(results: Mapping, arm: str, phase: str) -> float | None:
    """Seconds of a token ("decode") or of a prompt of ``phase`` tokens, from the arm's median rate."""
    if phase == "decode":
        rate = arm_value(results, arm, "decode_tok_s")
        return None if not rate else 1.0 / rate
    rate = arm_value(results, arm, "prefill_tok_s", int(phase))
    return None if not rate else int(phase) / rate


def _phases(results: Mapping) -> list[str]:
    lengths = sorted({int(k) for a in results.get("arms", []) for k in (a.get("prefill_tok_s") or {})})
    return ["decode", *map(str, lengths)]


def predict(base: Mapping, moe_layers: int) -> dict:
    """Per arm: predicted decode tok/s, prefill tok/s per length and host RSS peak (GB) at ``moe_layers``."""
    l0 = _moe_layers(base)
    ckpt = base.get("checkpoint") or {}
    layer_gb = (ckpt.get("experts") or 0) * (ckpt.get("expert_bytes") or 0) / 1e9
    out: dict = {}
    for arm in _arms(base):
        row: dict = {"decode_tok_s": None, "prefill_tok_s": {}, "host_rss_peak_gb": None}
        for phase in _phases(base):
            t_v, t = _seconds(base, "stock-vram", phase), _seconds(base, arm, phase)
            if t_v is None or t is None:
                continue
            predicted = cm.more_layers_s(t_v, t_v if arm == "stock-vram" else t, l0, moe_layers, DENSE_LAYERS)
            if phase == "decode":
                row["decode_tok_s"] = round(1.0 / predicted, 2)
            else:
                row["prefill_tok_s"][phase] = round(int(phase) / predicted, 1)
        rss = arm_value(base, arm, "host_rss_peak_gb")
        if rss is not None and layer_gb:
            row["host_rss_peak_gb"] = round(rss + HOST_COPIES.get(arm, 1) * (moe_layers - l0) * layer_gb, 2)
        out[arm] = row
    return out


def against(predicted: Mapping, measured: Mapping) -> dict:
    """Per arm and figure: the measured value and measured / predicted (None where either is missing)."""
    out: dict = {}
    for arm, row in predicted.items():
        got: dict = {}
        pairs = [("decode_tok_s", row["decode_tok_s"], arm_value(measured, arm, "decode_tok_s")),
                 ("host_rss_peak_gb", row["host_rss_peak_gb"], arm_value(measured, arm, "host_rss_peak_gb"))]
        pairs += [(f"prefill_{n}_tok_s", v, arm_value(measured, arm, "prefill_tok_s", int(n))) for n, v in row["prefill_tok_s"].items()]
        for key, want, have in pairs:
            got[key] = {"predicted": want, "measured": None if have is None else round(have, 2),
                        "ratio": round(have / want, 3) if want and have is not None else None}
        out[arm] = got
    return out


def report(base_path: Path, base: Mapping, moe_layers: int, measured_path: Path | None, measured: Mapping | None) -> dict:
    predicted = predict(base, moe_layers)
    out = {"base": str(base_path), "base_moe_layers": _moe_layers(base), "moe_layers": moe_layers, "model": __doc__.split("\n\n")[1],
           "predicted": predicted}
    if measured is not None:
        if _moe_layers(measured) != moe_layers:
            raise ValueError(f"{measured_path} is a run of {_moe_layers(measured)} MoE layers, not {moe_layers}")
        out["measured"] = str(measured_path)
        out["against"] = against(predicted, measured)
    return out


def table(result: Mapping) -> str:
    lines = [f"extrapolated from {result['base_moe_layers']} to {result['moe_layers']} MoE layers ({result['base']})"]
    for arm, row in result["predicted"].items():
        figures = [f"decode {row['decode_tok_s']} tok/s"] + [f"prefill {n} {v} tok/s" for n, v in row["prefill_tok_s"].items()]
        figures.append(f"host RSS {row['host_rss_peak_gb']} GB")
        line = f"  {arm}: " + ", ".join(figures)
        if "against" in result:
            ratios = [f"{k} {v['ratio']}x" for k, v in result["against"][arm].items() if v["ratio"] is not None]
            line += "; measured / predicted: " + (", ".join(ratios) or "none measured")
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    import json

    ap = argparse.ArgumentParser(prog="python3 -m bench.extrapolate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="a bench.compare results file (the smaller checkpoint)")
    ap.add_argument("--moe-layers", type=int, required=True, help="MoE layers to extrapolate to (42: GLM-5.3-Flash)")
    ap.add_argument("--measured", type=Path, help="a bench.compare results file at that size, to set the prediction against")
    ap.add_argument("--out", type=Path, help="write the JSON here (else print it)")
    args = ap.parse_args(argv)
    if args.moe_layers < 1:
        ap.error("--moe-layers takes a positive count")
    try:
        base = json.loads(args.base.read_text())
        measured = json.loads(args.measured.read_text()) if args.measured else None
        result = report(args.base, base, args.moe_layers, args.measured, measured)
    except (OSError, ValueError) as e:
        print(f"bench.extrapolate: {e}", file=sys.stderr)
        return 2
    emit_json(result, args.out)
    print(table(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
