"""Where the native libraries are found, and how they are built: shared by the loaders (``cpu_tier.kernel``,
``native.cuda``) and by ``setup.py``, which builds them into the package. Standard library only, because
``setup.py`` imports it in a build environment that has no torch.

A loader takes the first library that fits from, in order:

1. ``$GLM53_NATIVE_BUILD``: a directory of prebuilt libraries, taken as they are (for example one built for a
   GPU that the installed package was not built for);
2. the installed package's ``glm53/_native/``, where ``setup.py`` puts them (a wheel, ``pip install .``, the Nix
   package);
3. the source tree's ``native/build/`` (a checkout or an editable install). There a library older than one of
   its sources does not count, and a missing one is built on demand: ``make`` for the CPU library, nvcc for the
   CUDA one.

The expert cache's CUDA library is named for the GPU code it holds, ``libglm53_ec_<target>-<target>….so``: for
example ``libglm53_ec_sm_86-sm_90-compute_90.so`` holds machine code for compute capabilities 8.6 and 9.0 and PTX
that the driver can compile for 9.0 and later GPUs.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

OVERRIDE_ENV = "GLM53_NATIVE_BUILD"
PACKAGE = Path(__file__).resolve().parents[1]
INSTALLED = PACKAGE / "_native"
SOURCE = PACKAGE.parent / "native"  # absent in an installed package
CPU_LIBRARY = "libglm53_cpu_expert.so"
EC_PREFIX = "libglm53_ec_"
CUDA_HOME = Path("/usr/local/cuda")  # where find_nvcc looks last

_ARCH = re.compile(r"(\d+)\.(\d)([af]?)(\+PTX)?")  # a TORCH_CUDA_ARCH_LIST entry: 8.9, 9.0a, 9.0+PTX
_TARGET = re.compile(r"(sm|compute)_(\d+)(\d)([af]?)")  # an nvcc target: sm_89, sm_90a, compute_90


class NativeBuildError(RuntimeError):
    """A native library is missing and could not be built; the message says where it was looked for and what to do."""


def search_dirs() -> list[Path]:
    """The directories a loader looks in, in order: ``$GLM53_NATIVE_BUILD`` (when set), the installed
    ``glm53/_native/``, the source tree's ``native/build/``."""
    override = os.environ.get(OVERRIDE_ENV)
    return [*([Path(override)] if override else []), INSTALLED, SOURCE / "build"]


def find_or_build(what: str, pick: Callable[[list[Path]], Path | None], sources: Sequence[Path],
                  build: Callable[[], Path], fix: str) -> Path:
    """The library ``pick`` chooses in the first of :func:`search_dirs` that holds one, or else the one ``build()``
    makes in the source tree. In ``native/build/`` only files newer than every one of ``sources`` count.

    :param what: the library looked for, for messages.
    :param pick: the fitting library among a directory's files (sorted by name), or None.
    :param fix: what to do when none is found and none can be built, for the message.
    :raise NativeBuildError: none found, and there are no sources or the build failed; the message lists where
        it looked and what each place holds.
    """
    *prebuilt, tree = search_dirs()
    for directory in prebuilt:
        if (found := pick(_files(directory))) is not None:
            return found
    present = [s for s in sources if s.exists()]
    if present:
        newest = max(s.stat().st_mtime for s in present)
        if (found := pick([f for f in _files(tree) if f.stat().st_mtime >= newest])) is not None:
            return found
    looked = "; ".join(_holds(d) for d in [*prebuilt, *([tree] if present else [])])
    if not present:
        raise NativeBuildError(f"no {what} in {looked}, and no source tree to build one from. {fix}")
    try:
        return build()
    except NativeBuildError as err:
        raise NativeBuildError(f"no {what} in {looked}, and building one failed: {err}\n{fix}") from err


def named(name: str) -> Callable[[list[Path]], Path | None]:
    """A ``pick`` for :func:`find_or_build` that takes the file called ``name``."""
    return lambda files: next((f for f in files if f.name == name), None)


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []


def _holds(directory: Path) -> str:
    if not directory.is_dir():
        return f"{directory} (no such directory)"
    libraries = [p.name for p in _files(directory) if p.suffix == ".so"]
    return f"{directory} ({', '.join(libraries) or 'no libraries'})"


def build_cpu(native: Path, library: Path, jobs: int | None = None) -> Path:
    """Runs ``make -C native`` (make decides what is out of date) and returns ``library``, the file it builds.

    :raise NativeBuildError: no Makefile, no ``make``, or the build failed (e.g. no C++ compiler).
    """
    if not (native / "Makefile").exists():
        raise NativeBuildError(f"{native} has no Makefile to build {library.name} with")
    if shutil.which("make") is None:
        raise NativeBuildError(f"{library} is missing or out of date and `make` is not installed (Debian: apt-get install make g++)")
    library.parent.mkdir(parents=True, exist_ok=True)
    with open(library.parent / ".build.lock", "w") as lock:  # concurrent processes build once
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = subprocess.run(["make", "-C", str(native), "-j", str(jobs or min(4, os.cpu_count() or 1))],
                              check=False, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise NativeBuildError(f"building {library} failed (a C++ compiler is needed; Debian: apt-get install g++ make):\n{tail}")
    return library


def cuda_targets(arch_list: str) -> list[str]:
    """The nvcc targets a ``TORCH_CUDA_ARCH_LIST`` asks for: machine code for each capability, and PTX for those
    marked ``+PTX`` ("8.6;9.0+PTX" gives sm_86, sm_90, compute_90). Entries are separated by ";" or spaces.

    :raise ValueError: an entry that is not MAJOR.MINOR, optionally with a or f and +PTX (torch's names such as
        "Ampere" are not accepted), or no entry at all.
    """
    targets: list[str] = []
    for entry in arch_list.replace(";", " ").split():
        m = _ARCH.fullmatch(entry)
        if m is None:
            raise ValueError(f"TORCH_CUDA_ARCH_LIST: {entry!r} is not a compute capability such as 8.9, 9.0a or 9.0+PTX")
        code = f"{m[1]}{m[2]}{m[3]}"
        targets += [f"sm_{code}", f"compute_{code}"] if m[4] else [f"sm_{code}"]
    if not targets:
        raise ValueError(f"TORCH_CUDA_ARCH_LIST names no compute capability: {arch_list!r}")
    return list(dict.fromkeys(targets))


def ec_library_name(targets: Iterable[str]) -> str:
    return f"{EC_PREFIX}{'-'.join(targets)}.so"


def ec_library_targets(name: str) -> list[str] | None:
    """The nvcc targets an expert-cache library's file name says it holds; None for any other file."""
    if not (name.startswith(EC_PREFIX) and name.endswith(".so")):
        return None
    targets = name[len(EC_PREFIX):-len(".so")].split("-")
    return targets if all(_TARGET.fullmatch(t) for t in targets) else None


def target_fit(target: str, capability: tuple[int, int]) -> int:
    """How code for ``target`` runs on a GPU of ``capability``: 3 machine code for it, 2 machine code for an
    earlier GPU of the same major version (binary compatible), 1 PTX the driver compiles for it, 0 not at all.
    Arch-specific code (``sm_90a``) runs on its own capability only; family code (``sm_100f``) as plain code
    within its major version."""
    m = _TARGET.fullmatch(target)
    if m is None:
        raise ValueError(f"not an nvcc target: {target!r}")
    kind, own, variant = m[1], (int(m[2]), int(m[3])), m[4]
    same_major = own[0] == capability[0] and own[1] <= capability[1]
    if own == capability:
        return 3 if kind == "sm" else 1
    if variant == "a":
        return 0
    if kind == "sm":
        return 2 if same_major else 0
    return 1 if same_major or (variant == "" and own < capability) else 0


def pick_ec(files: Iterable[Path], capability: tuple[int, int]) -> Path | None:
    """The expert-cache library among ``files`` that fits a GPU of ``capability`` best (the first of equals)."""
    best, best_fit = None, 0
    for f in files:
        targets = ec_library_targets(f.name)
        fit = max((target_fit(t, capability) for t in targets), default=0) if targets else 0
        if fit > best_fit:
            best, best_fit = f, fit
    return best


def find_nvcc(environ: Mapping[str, str] | None = None) -> str | None:
    """nvcc from PATH, else ``$CUDA_HOME/bin``, else ``/usr/local/cuda/bin``; None when there is none."""
    environ = os.environ if environ is None else environ
    if found := shutil.which("nvcc", path=environ.get("PATH")):
        return found
    for home in (environ.get("CUDA_HOME"), CUDA_HOME):
        if home and (nvcc := Path(home) / "bin" / "nvcc").is_file():
            return str(nvcc)
    return None


def build_ec(nvcc: str, source: Path, out_dir: Path, targets: Sequence[str]) -> Path:
    """Compiles the expert cache's kernels into one library holding code for every target; returns its path.

    The library links the CUDA runtime dynamically, so it shares the one torch has loaded.

    :raise NativeBuildError: nvcc failed (its output is in the message).
    """
    out = out_dir / ec_library_name(targets)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # renamed when complete: a concurrent loader never sees half a file
    gencode = [f"-gencode=arch=compute_{t.split('_', 1)[1]},code={t}" for t in targets]
    cmd = [nvcc, "-O3", *gencode, "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared", "-o", str(tmp), str(source)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise NativeBuildError(f"{shlex.join(cmd)} failed:\n{done.stdout}{done.stderr}")
    tmp.replace(out)
    return out
