"""The ``glm53`` command: ``serve`` runs the server, ``info`` prints the effective configuration and preflight; the
tools (``synth``, ``calibrate-router``, ``panel``, ``triton-pin``) are in ``glm53/tools``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from . import __version__, config, plan, preflight
from .progress import TerminalProgress
from .tools import panel, triton_pin_record
from .tools.synth import presets

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="glm53", description="Serve GLM-5.3-Flash behind an OpenAI-compatible API.")
    ap.add_argument("--version", action="version", version=f"glm53 {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server", description="Run the server. Every setting can be given as a flag (below) or a GLM53_* variable; flags win, and for a flag given twice the last wins.")
    config.add_setting_flags(serve)
    info = sub.add_parser("info", help="effective configuration and a preflight report")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    config.add_setting_flags(info)
    synth = sub.add_parser(
        "synth", help="write a synthetic GLM-5.3-Flash checkpoint (real shapes and EXL3 format, random values)",
        description="Write a checkpoint that stock exllamav3 loads, deterministically from the seed: the same "
                    "arguments give byte-identical files. Runs on a CPU.")
    synth.add_argument("--preset", required=True, choices=tuple(presets.PRESETS),
                       help="tiny: 8 small layers (~0.6 GB); scaled: real shapes, --moe-layers MoE layers "
                            "(default 12, ~36 GB); full: all 45 layers")
    synth.add_argument("--out", required=True, type=Path, help="output directory (must be empty unless --force)")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    synth.add_argument("--moe-layers", type=int, help="number of MoE layers after the 3 dense ones")
    synth.add_argument("--routing", default="random", choices=tuple(presets.ROUTING_PRESETS),
                       help="routing dynamics: random (i.i.d. router logits, the default) or trained (picks recur over "
                            "tokens and the next layer's gate predicts the next layer's experts, as in a trained model)")
    synth.add_argument("--profile", type=Path, help="routing profile JSON (default: glm53/models/glm53-flash-routing-profile.json)")
    synth.add_argument("--stats-out", type=Path, help="also write the routing targets as an EXL3_MOE_CPU_SPLIT_STATS file")
    synth.add_argument("--force", action="store_true", help="overwrite the checkpoint files in a non-empty --out")
    cal = sub.add_parser(
        "calibrate-router", help="fit a synthetic checkpoint's router biases to routing measured on the GPU",
        description="Run the checkpoint in exllamav3 on a decode workload, count each expert's picks, and move the "
                    "router biases toward the routing profile until every layer's top-32 share is within the "
                    "tolerance; the biases are written into the checkpoint. Needs CUDA and exllamav3.")
    cal.add_argument("-m", "--model-dir", required=True, type=Path, help="a checkpoint written by `glm53 synth`")
    cal.add_argument("--rounds", type=int, default=10, help="most adjustment rounds (default 10)")
    cal.add_argument("--tolerance", type=float, default=0.05, help="largest accepted |top-32 share error| per layer")
    cal.add_argument("--profile", type=Path, help="routing profile JSON (default: glm53/models/glm53-flash-routing-profile.json)")
    cal.add_argument("--report", type=Path, help="write the per-round, per-layer report as JSON here")
    panel_cmd = sub.add_parser(
        "panel", help="build a reference panel with stock exllamav3 (for bench/score_ref_panel.py)",
        description="Greedy completions of thinking-off chat prompts and the top-k log-probabilities at every "
                    "completion position (one teacher-forced forward), by stock exllamav3 with no project "
                    "patches; format in reference/README.md. Needs CUDA and exllamav3.")
    panel.add_arguments(panel_cmd)
    triton_pin_record.add_parser(sub)
    plan.add_parser(sub)
    return ap


def _setting_argv(argv: list[str], ns: argparse.Namespace) -> list[str]:
    """The arguments after the subcommand, minus the subcommand's own options."""
    rest = argv[argv.index(ns.command) + 1:]
    return [a for a in rest if a != "--json"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = _parser().parse_args(argv)
    if ns.command == "triton-pin":
        return triton_pin_record.main(ns)
    if ns.command == "synth":
        return _synth(ns)
    if ns.command == "calibrate-router":
        return _calibrate(ns)
    if ns.command == "panel":
        return panel.run(ns, argv)
    if ns.command == "plan":
        try:
            return plan.run(ns)
        except ValueError as exc:
            print(f"glm53 plan: {exc}", file=sys.stderr)
            return 2
    try:
        settings = config.load(_setting_argv(argv, ns))
    except config.ConfigError as exc:
        print(f"glm53: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if ns.command == "info":
        return _info(settings, ns.json)
    return _serve(settings)


def _info(settings: config.Settings, as_json: bool) -> int:
    checks = preflight.run_checks(settings)
    if as_json:
        print(json.dumps({"version": __version__, "settings": settings.public(), "sources": dict(settings.sources),
                          "preflight": [c.__dict__ for c in checks]}, indent=2))
    else:
        print(f"glm53 {__version__}\n\nsettings:")
        print("\n".join(_settings_table(settings)))
        print("\npreflight:")
        for c in checks:
            print(f"  [{c.level:4}] {c.name}: {c.message}")
    return 1 if preflight.failures(checks) else 0


def _settings_table(settings: config.Settings) -> list[str]:
    """One row per setting: variable, value and where it came from, in columns as wide as their longest entry."""
    rows = [(config.env_var(name), str(value), settings.sources[name]) for name, value in settings.public().items()]
    name_width = max(len(r[0]) for r in rows)
    value_width = max(len(r[1]) for r in rows)
    return [f"  {name:{name_width}} {value:{value_width}} ({source})" for name, value, source in rows]


def _synth(ns: argparse.Namespace) -> int:
    # Imported here: only this command needs numpy and the writer.
    from .tools.synth.writer import write_checkpoint

    bar = TerminalProgress()
    try:
        write_checkpoint(ns.out, ns.preset, seed=ns.seed, moe_layers=ns.moe_layers, routing_preset=ns.routing, profile=ns.profile,
                         force=ns.force, stats_out=ns.stats_out, log=bar.echo, progress=bar)
    except (OSError, ValueError) as exc:
        print(f"glm53: {exc}", file=sys.stderr)
        return 1
    return 0


def _serve(settings: config.Settings) -> int:
    from .engine import resolve_engine
    from .models.download import DownloadError, download_checkpoint, needs_download

    if resolve_engine(settings)[0] == "exl3" and needs_download(settings):
        log.info("downloading %s@%s into %s", settings.model_repo, settings.model_revision, settings.model_dir)
        try:
            download_checkpoint(settings)
        except DownloadError as exc:
            print(f"glm53: not starting: {exc}", file=sys.stderr)
            return 1
    checks = preflight.run_checks(settings)
    for c in checks:
        log.log(logging.ERROR if c.level == "fail" else logging.INFO, "%s: %s", c.name, c.message)
    if preflight.failures(checks):
        print("glm53: not starting: " + "; ".join(c.message for c in preflight.failures(checks)), file=sys.stderr)
        return 1
    from .server.gunicorn_app import serve
    from .server.listener import ListenError, bind, bind_address

    try:
        listener = bind(settings.host, settings.port)  # before saying where it listens
    except ListenError as exc:
        print(f"glm53: not starting: {exc}", file=sys.stderr)
        return 1
    url = f"http://{bind_address(settings.host, settings.port)}"
    print(
        f"glm53 {__version__} listening on {url} (model {settings.served_name!r}; /health says when it is ready)\n"
        f"try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"max_tokens\": 64}}'",
        flush=True,
    )
    serve(settings, listener=listener)
    return 0


def _calibrate(ns: argparse.Namespace) -> int:
    from .tools.calibrate_router import calibrate

    bar = TerminalProgress()
    report = calibrate(ns.model_dir, ns.profile, rounds=ns.rounds, tolerance=ns.tolerance, log=bar.echo, progress=bar)
    if ns.report:
        ns.report.write_text(json.dumps(report, indent=1))
    last = report["rounds"][-1]
    print(f"{'passed' if report['passed'] else 'FAILED'}: max |top-32 share error| {last['max_top32_error']:.3f} "
          f"after {last['round']} round(s) (tolerance {report['tolerance']})")
    return 0 if report["passed"] else 1
