"""Builds the native libraries into the package; the project's metadata is in pyproject.toml.

A wheel, ``pip install .`` and the Nix package carry ``glm53/_native/`` with
- ``libglm53_cpu_expert.so``, the CPU tier's kernels (``make -C native``; needs g++ and make), and
- the expert cache's CUDA library, one file with code for every GPU that ``TORCH_CUDA_ARCH_LIST`` names (else for
  the GPUs nvidia-smi lists), when nvcc is found; without nvcc the package is built without it, and says so.
An editable install (``pip install -e .``) builds neither: the loaders then use the source tree's ``native/build/``
(``make native``; the CUDA library is compiled on first use). ``glm53/native/libraries.py`` has the details.

The libraries are machine code but no Python extension, so the wheel is tagged ``py3-none-<platform>``.
"""

import logging
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py
from setuptools.errors import SetupError

ROOT = Path(__file__).resolve().parent
NATIVE = ROOT / "native"
sys.path.insert(0, str(ROOT))
from glm53.native import libraries as native_lib  # standard library only: the build environment has no torch


def arch_list() -> str:
    """``TORCH_CUDA_ARCH_LIST``, else the compute capabilities of the GPUs nvidia-smi lists, else ''."""
    if archs := os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip():
        return archs
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    return ";".join(dict.fromkeys(listed.split()))


class BuildPy(build_py):
    """build_py, then the native libraries into ``glm53/_native/`` (not for an editable install)."""

    def run(self):
        super().run()
        if self.editable_mode:
            self.announce("glm53: editable install: no native libraries in the package; glm53 uses this tree's "
                          "native/build/ (`make native` builds the CPU library, nvcc the CUDA one on first use)", logging.WARNING)
            return
        out = Path(self.build_lib) / "glm53" / "_native"
        out.mkdir(parents=True, exist_ok=True)
        try:
            for library in self._build_native():
                self.copy_file(str(library), str(out / library.name))
        except (native_lib.NativeBuildError, ValueError) as err:
            raise SetupError(f"glm53: {err}") from err

    def _build_native(self) -> list[Path]:
        jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
        built = [native_lib.build_cpu(NATIVE, NATIVE / "build" / native_lib.CPU_LIBRARY, jobs)]
        asked = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
        nvcc = native_lib.find_nvcc()
        if nvcc is None:
            if asked:
                raise native_lib.NativeBuildError(f"TORCH_CUDA_ARCH_LIST={asked} asks for the expert cache's CUDA library, "
                                                  "but nvcc is not on PATH, in $CUDA_HOME/bin or in /usr/local/cuda/bin")
            self.announce("glm53: no nvcc: the package is built without the expert cache's CUDA library (the GPU offload "
                          "needs it; install the CUDA toolkit and rebuild, or provide one at run time in $GLM53_NATIVE_BUILD)", logging.WARNING)
            return built
        archs = arch_list()
        if not archs:
            self.announce("glm53: TORCH_CUDA_ARCH_LIST is unset and nvidia-smi lists no GPU: the package is built without "
                          "the expert cache's CUDA library (set TORCH_CUDA_ARCH_LIST, e.g. \"8.9\" or \"8.6;9.0\")", logging.WARNING)
            return built
        targets = native_lib.cuda_targets(archs)
        self.announce(f"glm53: building the expert cache's CUDA library for {', '.join(targets)}", logging.INFO)
        return [*built, native_lib.build_ec(nvcc, NATIVE / "ec" / "expert_cache.cu", NATIVE / "build", targets)]


class BinaryDistribution(Distribution):
    """The package carries machine code: it installs to platlib, and its wheel names a platform."""

    def has_ext_modules(self):
        return True


class BdistWheel(bdist_wheel):
    """No Python extension in it, so any Python 3 can use the wheel (the libraries are loaded with ctypes)."""

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPy, "bdist_wheel": BdistWheel})
