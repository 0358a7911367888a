"""Rewrite the README's "Measured" blocks from the results in ``bench/results/``.

    python3 -m bench.readme_measured [--results FILE] [--readme README.md] [--check]

The block between ``<!-- measured:begin -->`` and ``<!-- measured:end -->`` holds the latest full ``bench/compare.py``
run: the machine, the checkpoint, the bandwidths, a table of the arms (decode and prefill tok/s, hit rate and oracle
hit rate, host RSS, VRAM, the decode ratio to the best stock offload and to the exact-mode bound), the bounds, the
spread of the repeated arm, the goals, the chart and the command that reproduces the run. Without the markers, a
"Measured" section holding them is added before "## Development" (or at the end).

The block between ``<!-- ram-measured:begin -->`` and ``<!-- ram-measured:end -->`` holds the latest RAM-tier report
(``bench.ram_tier_decode``): exact decode and prefill with host RAM for part of the experts, against the bound.

The block between ``<!-- fast-measured:begin -->`` and ``<!-- fast-measured:end -->`` holds fast mode where its users
run it: the in-band link emulation's own check (``bench.bandwidth --link-emulate-gbs``, ``bench.link_sweep``), the
latest comparison at each emulated link rate, the paired decode KL against the noise floor, and the full model's
projections by the cost model (``glm53 plan``'s presets, labelled as projections, with the error band
``bench.predict`` measured). ``--check`` exits 1 when the README is not up to date.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import scoreboard
from glm53 import cost_model as cm

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
BEGIN, END = "<!-- measured:begin -->", "<!-- measured:end -->"
FAST_BEGIN, FAST_END = "<!-- fast-measured:begin -->", "<!-- fast-measured:end -->"
RAM_BEGIN, RAM_END = "<!-- ram-measured:begin -->", "<!-- ram-measured:end -->"
RAM_SCHEMA = "glm53.ram_tier/1"  # bench.ram_tier_decode's report
SECTION = "## Measured"


def latest_results(directory: Path = RESULTS_DIR) -> Path:
    """The compare results with the latest ``date`` among full comparisons (every arm run, stock-vram
    successfully: side runs of a few arms give partial ratios). :raise FileNotFoundError: there are none."""
    found = []
    for path in Path(directory).glob("*.json"):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("schema") == scoreboard.SCHEMA and scoreboard.ok_runs(doc, "stock-vram") \
                and {a.get("name") for a in doc.get("arms") or []} >= set(scoreboard.ARMS):
            found.append((doc.get("date", ""), path.name, path))
    if not found:
        raise FileNotFoundError(f"no {scoreboard.SCHEMA} results in {directory}")
    return max(found)[2]


def _num(value, fmt: str = "{:.1f}", none: str = "—") -> str:
    return none if value is None else fmt.format(value)


def _pct(value) -> str:
    return _num(value, "{:.1%}")


def _arm_rows(results: dict) -> list[str]:
    lengths = list((results.get("settings") or {}).get("prefill_lengths") or scoreboard.PREFILL_LENGTHS)
    streams = list((results.get("settings") or {}).get("streams") or ())
    head = ["arm", "decode tok/s"] + [f"{n} streams tok/s" for n in streams] + [f"prefill {n} tok/s" for n in lengths] + [
        "hit rate", "oracle hit rate", "host RSS peak GB", "VRAM GB", "decode / best stock offload", "decode / exact bound"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    repeated = {a["name"] for a in results.get("arms", []) if a.get("run", 1) > 1}
    for arm in results.get("arms", []):
        name = arm["name"] + (f" (run {arm['run']})" if arm["name"] in repeated else "")
        if arm["status"] != "ok":
            why = (arm.get("reason") or (arm.get("error_tail") or "").strip().splitlines()[-1:] or [""])
            why = why if isinstance(why, str) else why[0]
            rows.append(f"| {name} | {arm['status']}: {why[:80]} |" + " |" * (len(head) - 2))
            continue
        r = scoreboard.ratios(results, arm)
        cells = [name, _num(arm["decode_tok_s"])] + [_num((arm.get("decode_streams_tok_s") or {}).get(str(n))) for n in streams] + [
            _num((arm.get("prefill_tok_s") or {}).get(str(n)), "{:.0f}") for n in lengths] + [
            _pct(arm.get("hit_rate")), _pct(arm.get("oracle_hit_rate")), _num(arm.get("host_rss_peak_gb")),
            _num(arm.get("vram_max_allocated_gb")), _num(r["vs_stock_offload"], "{:.2f}x"), _num(r["vs_bound"], "{:.0%}")]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _bounds_lines(results: dict) -> list[str]:
    b = results.get("bounds") or {}
    if not b.get("available"):
        return [f"Bounds: not computed ({b.get('reason', 'no bounds in the results')})."]
    e = b["exact"]
    lines = [(f"Exact-mode decode bound: **{e['tok_s']:.1f} tok/s** = 1 / ({b['t_allvram_ms']:.2f} ms all-VRAM step + "
              f"{e['miss_bytes_per_token'] / 1e6:.0f} MB of misses per token at a {b['hit_rate']:.1%} hit rate "
              f"({b['hit_rate_source']}) over {b['link_gbs']:.1f} GB/s ({b['link']})).")]
    if "exact_oracle" in b:
        lines.append(f"At the oracle hit rate ({b['exact_oracle']['hit_rate']:.1%}): {b['exact_oracle']['tok_s']:.1f} tok/s.")
    if "fast" in b:
        f = b["fast"]
        lines.append(f"Fast-mode decode bound: **{f['tok_s']:.1f} tok/s**: misses at a {f['hit_rate']:.1%} hit rate over the link "
                     f"and the CPU tier together, {f['miss_gbs']:.1f} GB/s (CPU tier {f['cpu_tier_gbs']:.1f} GB/s, measured by the "
                     "engine at start; the sum capped by the DRAM read rate).")
    elif "fast_dram" in b:
        lines.append(f"Fast-mode upper bound ({b['fast_dram']['note']}): {b['fast_dram']['tok_s']:.1f} tok/s.")
    return lines


def _machine_line(results: dict, json_name: str) -> str:
    m, v = results.get("machine") or {}, results.get("versions") or {}
    return (f"Run of {results.get('date', '?')[:10]} (`bench/results/{json_name}`): {m.get('gpu')} (driver {m.get('driver')}), "
            f"{m.get('cpu')} ({m.get('cores_physical')} cores, {m.get('cores_logical')} CPUs), {_num(m.get('ram_gb'), '{:.0f}')} GB RAM; "
            f"exllamav3 {v.get('exllamav3')}, torch {v.get('torch')}, glm53 {v.get('git') or v.get('glm53')}.")


def _ram_lines(results: dict) -> list[str]:
    """Host RAM of the project arms against the checkpoint's routed experts and against preflight's estimate (arms
    that recorded it; earlier runs did not)."""
    parts = []
    routed = ((results.get("checkpoint") or {}).get("routed_expert_bytes") or 0) / 1e9
    for arm in results.get("arms") or []:
        rss, need = arm.get("host_rss_peak_gb"), arm.get("preflight_ram_gb")
        if arm.get("status") == "ok" and None not in (rss, need) and routed > 0 and need > 0:
            parts.append(f"{arm['name']} {_num(rss)} GB = {rss / routed:.2f}x its {_num(routed)} GB of routed experts, "
                         f"{rss / need:.2f}x preflight's {_num(need)} GB")
    return ["Host RSS peak: " + "; ".join(parts) + "."] if parts else []


def _checkpoint_line(results: dict) -> str:
    c, settings = results.get("checkpoint") or {}, results.get("settings") or {}
    placement = "hot-first from the routing profile" if c.get("stats_file") else "exllamav3's default placement"
    return (f"Checkpoint: synthetic `{c.get('preset')}` (seed {c.get('seed')}{', router calibrated' if c.get('calibrated') else ''}): "
            f"{c.get('moe_layers')} MoE layers x {c.get('experts')} experts, top-{c.get('top_k')}, {_num((c.get('bytes') or 0) / 1e9)} GB "
            f"({_num((c.get('routed_expert_bytes') or 0) / 1e9)} GB of routed experts, "
            f"{_num((c.get('expert_bytes') or 0) / 1e6, '{:.2f}')} MB each). The offload arms keep {c.get('gpu_experts')} of "
            f"{c.get('experts')} experts per layer in VRAM (stock: `-mcs {settings.get('mcs')}`, {placement}; project: "
            f"`--ec-cache-experts` set to the same share, placed by the routing profile, under a VRAM limit with room for "
            f"the two prefill staging buffers). Decode: {settings.get('decode_tokens')} tokens after a "
            f"{settings.get('decode_context')}-token prompt, greedy, one stream; prefill: time to the first token of fresh random prompts.")


def _bandwidth_line(results: dict) -> str:
    bw = results.get("bandwidth") or {}
    return (f"Bandwidths: PCIe {_num(bw.get('pcie_h2d_gbs'))} GB/s pinned copy, {_num(bw.get('pcie_zero_copy_read_gbs'))} GB/s "
            f"zero-copy read; DRAM {_num(bw.get('dram_read_gbs'))} GB/s read ({bw.get('dram_threads')} threads); "
            f"HBM {_num(bw.get('hbm_copy_gbs'))} GB/s copy.")


def measured_block(results: dict, json_name: str) -> str:
    """The Markdown between the markers (without them)."""
    out = [_machine_line(results, json_name), "", _checkpoint_line(results), "", _bandwidth_line(results), "",
           *_arm_rows(results), "", *_bounds_lines(results), *_ram_lines(results)]
    for name, s in (results.get("spread") or {}).items():
        parts = [f"{k.replace('_tok_s', '').replace('_', ' ')} {x['relative']:.1%}" for k, x in s.items() if isinstance(x, dict)]
        out.append(f"Spread of {name} over {s['runs']} runs ((max - min) / mean): {', '.join(parts)}.")
    goals = [g for g in results.get("goals") or [] if g["ratio"] is not None]
    if goals:
        out += ["", "Goals: " + "; ".join(f"{g['goal']} = {g['ratio']:.2f} (target {g['target']}, {'met' if g['met'] else 'not met'})" for g in goals) + "."]
    if results.get("chart"):
        out += ["", f"![decode and prefill tok/s per arm](bench/results/{results['chart']})"]
    out += ["", "Reproduce (on the GPU machine, the device kit in `.gpu/`):", "", "```sh", results.get("command", ""), "```"]
    return "\n".join(out)


def _documents(directory: Path) -> list[tuple[str, dict]]:
    out = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            out.append((path.name, doc))
    return out


def _latest(docs, keep) -> tuple[str, dict] | None:
    """The document ``keep`` accepts with the latest date (or name: results are named by date)."""
    found = [(doc.get("date", name[:10]), name, doc) for name, doc in docs if keep(name, doc)]
    return (max(found)[1], max(found)[2]) if found else None


def _emulation_lines(docs) -> list[str]:
    lines = []
    check = _latest(docs, lambda n, d: "targets" in (d.get("link_emulation") or {}) and "schema" not in d)
    if check:
        name, doc = check
        e = doc["link_emulation"]
        worst = max(abs(r[k] - 1) for r in e["targets"] for k in r if k.endswith("_ratio"))
        targets = ", ".join(f"{r['target_gbs']:g}" for r in e["targets"])
        lines.append(f"The in-band link emulation (`GLM53_LINK_EMULATE_GBS`) reads its target within {worst:.1%} at "
                     f"{targets} GB/s (zero-copy reads by a full grid and by 64 "
                     f"blocks, copy-engine copies; the link measured {e['measured']['zero_copy_gbs']:.1f} GB/s zero-copy, "
                     f"{e['measured']['copy_gbs']:.1f} GB/s copies; `bench/results/{name}`).")
    sweep = _latest(docs, lambda n, d: "engines" in d and "check" in d)
    if sweep:
        name, doc = sweep
        c = doc["check"]
        model = ", ".join(f"{k} GB/s {v:.3f}" for k, v in (c.get("measured_over_model") or {}).items())
        lines.append(f"On exact mode's decode (`bench.link_sweep`, `bench/results/{name}`) a step under emulation takes "
                     f"{model} of the per-layer model's T_fix + misses x B / W_target, the same tokens at every rate "
                     f"({'yes' if all((c.get('same_tokens') or {}).values()) else 'NO'}); at the measured rate "
                     f"{c.get('measured_rate_over_full')} of the full link's step time. Fast / exact on one engine each: "
                     + ", ".join(f"{k} {v:.2f}x" for k, v in (doc.get("fast_over_exact") or {}).items()) + ".")
    return lines


def _emulated_compare_rows(docs) -> list[str]:
    """Every comparison run with the project arms' link emulated, slowest link first (each run a row: runs of one rate
    at other commits differ in what they measured, and both stay)."""
    runs = [(name, doc) for name, doc in docs if doc.get("schema") == scoreboard.SCHEMA and scoreboard.emulated_link_gbs(doc)]
    if not runs:
        return []
    rows = ["| link (emulated) | exact tok/s | fast tok/s | fast / exact | 4 streams exact | 4 streams fast | fast / exact | best stock "
            "offload (full link) | results |", "|---|---|---|---|---|---|---|---|---|"]
    for name, doc in sorted(runs, key=lambda r: (scoreboard.emulated_link_gbs(r[1]), r[1].get("date", ""))):
        e, f = scoreboard.arm_value(doc, "exact", "decode_tok_s"), scoreboard.arm_value(doc, "fast", "decode_tok_s")
        streams = lambda arm: ((scoreboard.ok_runs(doc, arm) or [{}])[0].get("decode_streams_tok_s") or {}).get("4")  # noqa: E731
        e4, f4 = streams("exact"), streams("fast")
        best = scoreboard.best_stock_offload(doc)
        rows.append(f"| {scoreboard.emulated_link_gbs(doc):g} GB/s | {_num(e)} | {_num(f)} | {_num(f / e if e and f else None, '{:.2f}x')} | "
                    f"{_num(e4)} | {_num(f4)} | {_num(f4 / e4 if e4 and f4 else None, '{:.2f}x')} | "
                    f"{f'{best[1]:.1f} ({best[0]})' if best else '—'} | `{name}` |")
    return rows


def _quality_line(docs) -> list[str]:
    floor = _latest(docs, lambda n, d: "decode-kl" in n and "floor" in n and "kl_mean" in d)
    fast = _latest(docs, lambda n, d: "decode-kl" in n and "fast" in n and "int16" in n and "kl_mean" in d)
    if not (floor and fast):
        return []
    f, b = fast[1], floor[1]
    return [f"Quality, int16 codebook, every miss to the CPU tier (`bench.decode_kl --split all`, scaled checkpoint): paired decode KL "
            f"{f['kl_mean']:.4f} against a noise floor of {b['kl_mean']:.4f} (exllamav3 perturbed by 1e-3), "
            f"{f['kl_mean'] / b['kl_mean']:.2f}x the floor (`bench/results/{fast[0]}`, `bench/results/{floor[0]}`)."]


def _projection_rows() -> list[str]:
    profile = cm.load_profile(cm.PROFILE)
    band = cm.error_band()
    rows = ["Projections by the cost model (`glm53 plan`), not measurements; its error on the recorded runs "
            + (f"(`bench.predict`): {band['within_10pct']} of {band['arms']} arms within 10 %, median {band['median_abs_error']:.1%}, "
               f"90th percentile {band['p90_abs_error']:.0%}." if band else "has not been measured."), "",
            "| rig (full GLM-5.3-Flash, 24 GB card) | exact tok/s (1 / 4 streams) | fast tok/s (1 / 4 streams) | prefill 8k exact / fast | "
            "published |", "|---|---|---|---|---|"]
    for name, rig in cm.PRESETS.items():
        p = cm.project(rig, profile)
        d = p.decode_tok_s
        pub = ", ".join(f"{k} {v:g}" for k, v in rig.published.items() if k.endswith("tok_s") and "prefill" not in k) or "—"
        rows.append(f"| `{name}` | {d['exact'][1]:.1f} / {d['exact'][4]:.1f} | {d['fast'][1]:.1f} / {d['fast'][4]:.1f} | "
                    f"{p.prefill_tok_s['exact']:.0f} / {p.prefill_tok_s['fast']:.0f} | {pub} |")
    return rows


def fast_block(directory: Path = RESULTS_DIR) -> str:
    """The Markdown of fast mode's block (without the markers)."""
    docs = _documents(directory)
    out = _emulation_lines(docs)
    rows = _emulated_compare_rows(docs)
    if rows:
        out += ["", "On the H200 test host (16 CPUs, scaled checkpoint, a 24 GB card's share), `bench.compare` with the project "
                "arms' link emulated (the stock arms at the full link: their decode reads no expert over the link):", "", *rows]
    out += ["", *_quality_line(docs), "", *_projection_rows()]
    return "\n".join(out).strip()


def ram_block(directory: Path = RESULTS_DIR) -> str:
    """The Markdown of the RAM tier's block (without the markers): the latest report's table and goals. A share the
    latest report did not run (a call of the device runs some shares only) comes from the newest report that did,
    named in the row's last column."""
    reports = sorted(((d.get("date", n[:10]), n, d) for n, d in _documents(directory) if d.get("schema") == RAM_SCHEMA),
                     reverse=True)
    if not reports:
        return "No RAM-tier run recorded yet (`bench/run_offload_checks.sh ram-tier`)."
    _, name, doc = reports[0]
    m = doc.get("machine") or {}
    t_fix = f"T_fix {doc['t_fix_ms']} ms" if doc.get("t_fix_ms") is not None else "T_fix (no 100 % run in this report)"
    lines = [f"Exact mode with host RAM for part of the experts (`GLM53_HOST_RAM_GB`; the rest read from the checkpoint's files "
             f"with O_DIRECT), {m.get('gpu', 'GPU')}, {doc['checkpoint'].get('preset', 'synthetic')} checkpoint, a 24 GB card's share "
             f"in VRAM (`bench/results/{name}`, {doc.get('date', '')[:10]}). Bound per token: max({t_fix}, "
             f"VRAM misses x B / {doc['w_link_gbs']} GB/s + disk reads x B / the disk's rate in the same run).", "",
             "| RAM for experts | decode tok/s | bound tok/s | of bound | disk reads / token | disk GB/s | prefill tok/s | prefill of its disk bound | host RSS peak GB | report |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    shares = sorted({s for _, _, d in reports for s in d.get("by_ram_share") or {}}, key=lambda s: -float(s))
    for share in shares:
        ran = [(n, d["by_ram_share"][share]) for _, n, d in reports if "decode_tok_s" in (d.get("by_ram_share") or {}).get(share, {})]
        if not ran:
            status = (doc.get("by_ram_share") or {}).get(share, {}).get("status", "—")
            lines.append(f"| {share} % | {status} | | | | | | | | |")
            continue
        source, row = ran[0]
        lines.append(f"| {share} % | {row['decode_tok_s']:.2f} | {_num(row['bound_tok_s'], '{:.2f}')} | {_num(row['of_bound'], '{:.3f}')} | "
                     f"{row['disk_reads_per_token']:.1f} | {_num(row['w_disk_gbs'] if row['disk_reads_per_token'] else None, '{:.2f}')} | "
                     f"{_num(row.get('prefill_tok_s'), '{:.0f}')} | {_num(row.get('prefill_of_bound'), '{:.2f}')} | "
                     f"{_num(row.get('host_rss_peak_gb'))} | {'this one' if source == name else f'`{source}`'} |")
    goals = doc.get("goals") or {}
    if goals:
        lines += ["", "Goals at 50 % (this report): " + "; ".join(
            f"{k} {v['value']:.3g} (target {v['target']:.3g}, {'met' if v['met'] else 'NOT met'})" for k, v in goals.items()) + "."]
    return "\n".join(lines)


def _rewrite_between(readme: str, begin: str, end: str, block: str) -> str:
    if begin not in readme or end not in readme:
        return readme
    head, _, rest = readme.partition(begin)
    _, _, tail = rest.partition(end)
    return f"{head}{begin}\n{block}\n{end}{tail}"


def rewrite_fast(readme: str, block: str) -> str:
    """``readme`` with ``block`` between the fast-mode markers (unchanged where there are none)."""
    return _rewrite_between(readme, FAST_BEGIN, FAST_END, block)


def rewrite_ram(readme: str, block: str) -> str:
    """``readme`` with ``block`` between the RAM tier's markers (unchanged where there are none)."""
    return _rewrite_between(readme, RAM_BEGIN, RAM_END, block)


def rewrite(readme: str, block: str) -> str:
    """``readme`` with ``block`` between the markers (a "Measured" section is added where there are none)."""
    if BEGIN in readme and END in readme:
        head, _, rest = readme.partition(BEGIN)
        _, _, tail = rest.partition(END)
        return f"{head}{BEGIN}\n{block}\n{END}{tail}"
    section = f"{SECTION}\n\n{BEGIN}\n{block}\n{END}\n"
    anchor = "\n## Development"
    if anchor in readme:
        head, _, tail = readme.partition(anchor)
        return f"{head.rstrip()}\n\n{section}{anchor}{tail}"
    return f"{readme.rstrip()}\n\n{section}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.readme_measured", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, help="a results JSON (default: the latest in bench/results/)")
    ap.add_argument("--readme", type=Path, default=REPO / "README.md")
    ap.add_argument("--check", action="store_true", help="only report whether the README is up to date (exit 1 if not)")
    args = ap.parse_args(argv)
    path = args.results or latest_results()
    results = scoreboard.finish(json.loads(path.read_text()))  # the derived sections by today's arithmetic
    new = rewrite_fast(rewrite(args.readme.read_text(), measured_block(results, path.name)), fast_block(path.parent))
    new = rewrite_ram(new, ram_block(path.parent))
    if args.check:
        stale = new != args.readme.read_text()
        print(f"{args.readme}: {'stale' if stale else 'up to date'} against {path.name}")
        return 1 if stale else 0
    args.readme.write_text(new)
    print(f"{args.readme}: Measured block from {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
