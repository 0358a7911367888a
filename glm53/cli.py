"""The ``glm53`` command: ``serve`` runs the server, ``info`` prints the effective configuration and preflight."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from . import __version__, config, preflight


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="glm53", description="Serve GLM-5.3-Flash behind an OpenAI-compatible API.")
    ap.add_argument("--version", action="version", version=f"glm53 {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the server", description="Run the server. Every setting can be given as a flag (below) or a GLM53_* variable; flags win, and for a flag given twice the last wins.")
    config.add_setting_flags(serve)
    info = sub.add_parser("info", help="effective configuration and a preflight report")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    config.add_setting_flags(info)
    return ap


def _setting_argv(argv: list[str], ns: argparse.Namespace) -> list[str]:
    """The arguments after the subcommand, minus the subcommand's own options."""
    rest = argv[argv.index(ns.command) + 1:]
    return [a for a in rest if a != "--json"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ns = _parser().parse_args(argv)
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
        for name, value in settings.public().items():
            print(f"  {config.env_var(name):24} {value!s:44} ({settings.sources[name]})")
        print("\npreflight:")
        for c in checks:
            print(f"  [{c.level:4}] {c.name}: {c.message}")
    return 1 if preflight.failures(checks) else 0


def _serve(settings: config.Settings) -> int:
    checks = preflight.run_checks(settings)
    for c in checks:
        logging.getLogger("glm53.preflight").log(logging.ERROR if c.level == "fail" else logging.INFO, "%s: %s", c.name, c.message)
    if preflight.failures(checks):
        print("glm53: not starting: " + "; ".join(c.message for c in preflight.failures(checks)), file=sys.stderr)
        return 1
    from .server.gunicorn_app import serve

    url = f"http://{settings.host}:{settings.port}"
    print(
        f"glm53 {__version__} listening on {url} (model {settings.served_name!r}; /health says when it is ready)\n"
        f"try:  curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], \"max_tokens\": 64}}'",
        flush=True,
    )
    serve(settings)
    return 0
