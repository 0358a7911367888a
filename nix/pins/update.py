#!/usr/bin/env python3
"""Regenerate ``nix/pins/pypi.json``: every PyPI artifact the Nix build fetches, by content-addressed URL and hash.

    python3 nix/pins/update.py            # rewrite the pins from PyPI
    python3 nix/pins/update.py --dry-run  # print what would change, write nothing

Steps, in order:

1. Read the requirements of the served program (``dependencies`` plus the ``serve``, ``gpu`` and ``hub`` extras)
   and of the development shell (the ``dev`` extra) from ``pyproject.toml``, and add ``CONSTRAINTS``.
2. Ask pip's resolver for one consistent set of binary wheels for CPython 3.13 on manylinux x86_64. pip's
   configuration files and ``PIP_*`` variables are switched off, so a machine's local wheel directories, extra
   indexes or version caps never leak into the pins.
3. Recompute the dependency graph with environment markers evaluated for the target: pip evaluates markers for
   the interpreter it runs on, which need not be 3.13. A graph that needs a package pip did not resolve, or a
   version pip resolved that a requirement refuses, stops the script.
4. Take every file's URL and sha256 from PyPI's JSON simple index (PEP 691) and refuse a file whose hash differs
   from the one pip saw, or that is yanked.
5. Leave out the CUDA runtime wheels (``nvidia-*``, ``cuda-toolkit``) as Python packages. Those of ``LINKED`` are
   pinned under ``libraries``: the Nix build links torch against their shared libraries. The others' libraries
   come from ``cudaPackages_13_2``, the way nixpkgs' ``torch-bin`` does; their resolved versions are kept under
   ``replaced``. ``nix/pins/torch_cuda.py`` then records which of these torch needs and that the versions used
   satisfy it (``nix/pins/torch-cuda.json``).

Resolution follows PyPI as it is today, so running this script twice a week apart can give different pins: it
is run by hand when the dependencies change, never by CI. CI checks the pins themselves (``nix/ci/check.sh``).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
from collections import defaultdict
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pip vendors the same library; every Python that can run this script has pip
    from pip._vendor.packaging.markers import Marker  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]
INDEX = "https://pypi.org/simple/"
FILES_HOST = "https://files.pythonhosted.org/packages/"

PYTHON = "3.13"  # nixpkgs' python313: torch's and exllamav3's wheels exist for it, triton's abi3 wheel covers it
# Highest manylinux level accepted: glibc 2.40 is what nixos-25.05 shipped, and nixos-26.05 ships a newer one, so
# every accepted wheel loads against the pinned glibc (nix/pkgs/python-set.nix asserts this at build time).
MANYLINUX_MAX = 40
# The issue pins these exact versions; pyproject.toml only gives lower bounds.
CONSTRAINTS = ["torch==2.15.0", "triton==3.9.0"]
RUNTIME_EXTRAS = ("serve", "gpu", "hub")
DEV_EXTRAS = ("dev",)
# CUDA wheels torch's metadata pins to an exact build (``==``) outside the CUDA 13.2 toolkit release: nixpkgs builds
# other versions (at the revisions read: NCCL 2.27-2.30, NVSHMEM 3.4-3.6, cuDNN 9.20 or 9.27, cuSPARSELt 0.8.1 or
# 0.10.0), and the older NCCL and NVSHMEM lack functions torch imports (nix/pins/torch-cuda.json), so the Nix build
# links torch against these wheels' libraries (nix/pkgs/cuda-wheel-libs.nix).
LINKED = {"nvidia-cudnn-cu13", "nvidia-cusparselt-cu13", "nvidia-nccl-cu13", "nvidia-nvshmem-cu13"}
# Packages the Nix build provides another way, with the reason recorded next to the pins.
REMOVED = {
    "ninja": "exllamav3 only runs ninja for its first-import JIT build; Nix compiles exllamav3_ext at build time",
}

# Environment markers of the target interpreter (PEP 508). nixpkgs' python313 is some 3.13.x; markers on the
# patch level are rare enough that 3.13.0 stands for all of them.
TARGET_ENV = {
    "implementation_name": "cpython",
    "implementation_version": "3.13.0",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.13.0",
    "python_version": PYTHON,
    "sys_platform": "linux",
}


def is_cuda_wheel(name: str) -> bool:
    """CUDA runtime wheels: never a Python dependency in the Nix build."""
    return name.startswith("nvidia-") or name == "cuda-toolkit"


def is_replaced(name: str) -> bool:
    """CUDA runtime wheels whose libraries come from cudaPackages_13_2 in the Nix build."""
    return is_cuda_wheel(name) and name not in LINKED


def requirement_groups(pyproject: Path) -> dict[str, list[str]]:
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {})
    runtime = list(project.get("dependencies", []))
    for extra in RUNTIME_EXTRAS:
        runtime += extras[extra]
    dev = [r for extra in DEV_EXTRAS for r in extras[extra]]
    return {"runtime": runtime, "dev": dev}


def resolve(requirements: list[str], workdir: Path) -> dict[str, dict]:
    """pip's resolution for the target, as {canonical name: report item}."""
    platforms = [f"manylinux_2_{minor}_x86_64" for minor in range(MANYLINUX_MAX, 16, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    # pip before 23.3 does not expand a manylinux tag to the older ones it implies, so every level is listed.
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--target", str(workdir / "target"), "--report", str(workdir / "report.json"),
           "--index-url", INDEX, "--only-binary=:all:", "--implementation", "cp",
           "--python-version", PYTHON, "--abi", "cp" + PYTHON.replace(".", "")]
    for platform in platforms:
        cmd += ["--platform", platform]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf: local indexes and caps must not shape the pins
    subprocess.run(cmd + requirements, check=True, env=env)
    report = json.loads((workdir / "report.json").read_text())
    return {canonicalize_name(item["metadata"]["name"]): item for item in report["install"]}


class Closure:
    """The dependency graph below a set of requirements, markers evaluated for the target interpreter."""

    def __init__(self, resolved: dict[str, dict]):
        self.resolved = resolved
        self.extras: dict[str, set[str]] = defaultdict(set)
        self.deps: dict[str, set[str]] = defaultdict(set)
        self.dropped: dict[str, set[str]] = defaultdict(set)
        self.visited: set[str] = set()
        self.libraries: set[str] = set()

    def add(self, requirement: str, parent: str | None = None) -> str | None:
        req = Requirement(requirement)
        name = canonicalize_name(req.name)
        if is_cuda_wheel(name) or name in REMOVED:
            if parent:
                self.dropped[parent].add(name)
            if name in LINKED:
                self._check_version(req, name, parent)
                self.libraries.add(name)
            return None
        item = self.resolved.get(name)
        if item is None:
            raise SystemExit(f"{requirement!r} (needed by {parent or 'pyproject.toml'}) was not resolved by pip; "
                             "its marker is true on the target but not on the interpreter pip ran on")
        self._check_version(req, name, parent)
        if parent:
            self.deps[parent].add(name)
        new_extras = set(req.extras) - self.extras[name]
        if name in self.visited and not new_extras:
            return name
        self.visited.add(name)
        self.extras[name] |= new_extras
        for dep in item["metadata"].get("requires_dist") or []:
            if self._applies(Requirement(dep), name):
                self.add(dep, name)
        return name

    def _check_version(self, req: Requirement, name: str, parent: str | None) -> None:
        item = self.resolved.get(name)
        if item is None:
            raise SystemExit(f"{str(req)!r} (needed by {parent or 'pyproject.toml'}) was not resolved by pip")
        version = item["metadata"]["version"]
        if not req.specifier.contains(Version(version), prereleases=True):
            raise SystemExit(f"pip resolved {name} {version}, which {str(req)!r} refuses")

    def _applies(self, req: Requirement, name: str) -> bool:
        if req.marker is None:
            return True
        return any(req.marker.evaluate(TARGET_ENV | {"extra": extra}) for extra in ["", *sorted(self.extras[name])])

    def roots(self, requirements: list[str]) -> list[str]:
        names = []
        for requirement in requirements:
            req = Requirement(requirement)
            if req.marker is None or req.marker.evaluate(TARGET_ENV | {"extra": ""}):
                name = self.add(requirement)
                if name:
                    names.append(name)
        return sorted(set(names))


def index_entry(name: str, filename: str) -> dict:
    request = urllib.request.Request(INDEX + name + "/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    for entry in files:
        if entry["filename"] == filename:
            return entry
    raise SystemExit(f"{filename} is not in PyPI's index of {name}")


def sri(hex_digest: str) -> str:
    return "sha256-" + base64.b64encode(bytes.fromhex(hex_digest)).decode()


def pinned_file(item: dict) -> dict:
    """The file pip chose for one package, by content-addressed URL and hash, checked against PyPI's index."""
    name = canonicalize_name(item["metadata"]["name"])
    url = item["download_info"]["url"]
    filename = url.rsplit("/", 1)[1]
    pip_sha256 = item["download_info"]["archive_info"]["hashes"]["sha256"]
    entry = index_entry(name, filename)
    if entry["hashes"].get("sha256") != pip_sha256:
        raise SystemExit(f"{filename}: PyPI's index says sha256 {entry['hashes'].get('sha256')}, pip saw {pip_sha256}")
    if entry.get("yanked"):
        raise SystemExit(f"{filename} is yanked on PyPI ({entry['yanked']}); pin another version")
    if not entry["url"].startswith(FILES_HOST) or not entry["url"].endswith("/" + filename):
        raise SystemExit(f"{filename}: the index gives {entry['url']}, not a content-addressed files.pythonhosted.org URL")
    return {"version": item["metadata"]["version"], "filename": filename, "url": entry["url"],
            "sha256": pip_sha256, "hash": sri(pip_sha256)}


def pins(pyproject: Path) -> dict:
    groups = requirement_groups(pyproject)
    with tempfile.TemporaryDirectory() as tmp:
        resolved = resolve(groups["runtime"] + groups["dev"] + CONSTRAINTS, Path(tmp))
    closure = Closure(resolved)
    for constraint in CONSTRAINTS:
        closure.add(constraint)
    roots = {group: closure.roots(requirements) for group, requirements in groups.items()}

    packages = {name: pinned_file(resolved[name]) | {"deps": sorted(closure.deps[name]), "dropped": sorted(closure.dropped[name])}
                for name in sorted(closure.visited)}
    libraries = {name: pinned_file(resolved[name]) for name in sorted(closure.libraries)}
    unused = sorted(n for n in resolved if n not in closure.visited and not is_cuda_wheel(n) and n not in REMOVED)
    if unused:
        print(f"left out (resolved by pip, unused on CPython {PYTHON} Linux): {', '.join(unused)}", file=sys.stderr)
    return {
        "python": PYTHON,
        "manylinuxMax": f"2.{MANYLINUX_MAX}",
        "requirements": groups,
        "constraints": CONSTRAINTS,
        "roots": roots,
        "removed": REMOVED,
        "replaced": {n: resolved[n]["metadata"]["version"] for n in sorted(resolved) if is_replaced(n)},
        "libraries": libraries,
        "packages": packages,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pyproject", type=Path, default=REPO / "pyproject.toml")
    ap.add_argument("--out", type=Path, default=REPO / "nix" / "pins" / "pypi.json")
    ap.add_argument("--dry-run", action="store_true", help="print the packages that would change; write nothing")
    args = ap.parse_args()
    new = pins(args.pyproject)
    text = json.dumps(new, indent=2, sort_keys=True) + "\n"
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    for section in ("packages", "libraries"):
        old, now = previous.get(section, {}), new[section]
        for name in sorted(set(old) | set(now)):
            before, after = old.get(name, {}).get("version"), now.get(name, {}).get("version")
            if before != after:
                print(f"{name}: {before or '-'} -> {after or '-'}")
    if not args.dry_run:
        args.out.write_text(text)
        where = args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out
        print(f"wrote {where} ({len(new['packages'])} packages, {len(new['libraries'])} CUDA libraries)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
