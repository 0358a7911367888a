"""The package build (setup.py): a wheel carries the native libraries in glm53/_native/, and the installed package
loads them from there; an sdist carries what they are built from.

The wheels are built from a copy of the tree with ``pip wheel --no-build-isolation`` (offline). The copy takes the
checkout's native/build/ along, so make has nothing to do when ``make native`` has run (as in ``make test``): a
few seconds; from nothing, about 30 s more on two cores.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from glm53.native import libraries as native_lib

REPO = Path(__file__).resolve().parents[1]
PACKAGE_SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "glm53", "native")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("setuptools.command.bdist_wheel") is None,
                                reason="setuptools >= 70.1 is needed to build the wheel without build isolation")


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of what the package is built from."""
    root = tmp_path_factory.mktemp("tree")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".build.lock")
    for name in PACKAGE_SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, root / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, root / name)
    return root


def build_wheel(tree: Path, out: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    environ = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_ARCH_LIST"} | env
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-v",
                           "-w", str(out)], cwd=tree, env=environ, capture_output=True, text=True, timeout=600, check=False)
    wheels = sorted(out.glob("*.whl"))
    names = zipfile.ZipFile(wheels[0]).namelist() if done.returncode == 0 else []
    return done, names


@pytest.fixture(scope="module")
def wheel(tree, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done, _ = build_wheel(tree, out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return next(out.glob("*.whl"))


def test_the_wheel_carries_the_cpu_library_and_names_its_platform(wheel):
    assert wheel.name == "glm53-0.1.0-py3-none-linux_x86_64.whl"
    names = zipfile.ZipFile(wheel).namelist()
    assert f"glm53/_native/{native_lib.CPU_LIBRARY}" in names
    assert "glm53/native/libraries.py" in names
    # what glm53 plan and glm53 synth read in an installed package: the routing profile, the cost model's error band
    assert {"glm53/models/glm53-flash-routing-profile.json", "glm53/cost_model_error.json"} <= set(names)
    assert not [n for n in names if n.startswith("native/")]
    text = zipfile.ZipFile(wheel).read("glm53-0.1.0.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: false" in text


def test_the_installed_package_loads_its_own_cpu_library(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = ("import glm53, glm53.cpu_tier.kernel as ce; "
             "print(glm53.__file__); print(ce.locate()); print(','.join(ce.available_isas()))")
    environ = {k: v for k, v in os.environ.items() if k != native_lib.OVERRIDE_ENV} | {"PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=environ, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    module, library, isas = done.stdout.split()
    assert module == str(site / "glm53" / "__init__.py")
    assert library == str(site / "glm53" / "_native" / native_lib.CPU_LIBRARY)
    assert "scalar" in isas.split(",")


@pytest.mark.skipif(native_lib.find_nvcc() is None, reason="no nvcc here")
def test_with_nvcc_the_wheel_carries_one_cuda_library_for_every_architecture_asked(tree, tmp_path):
    done, names = build_wheel(tree, tmp_path, TORCH_CUDA_ARCH_LIST="8.6;9.0+PTX")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(n for n in names if n.startswith("glm53/_native/")) == [
        f"glm53/_native/{native_lib.CPU_LIBRARY}", "glm53/_native/libglm53_ec_sm_86-sm_90-compute_90.so"]


@pytest.mark.skipif(native_lib.find_nvcc() is not None, reason="nvcc is here")
def test_without_nvcc_the_cuda_library_is_left_out_unless_asked_for(wheel, tree, tmp_path):
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if "libglm53_ec_" in n]
    done, _ = build_wheel(tree, tmp_path, TORCH_CUDA_ARCH_LIST="9.0")
    assert done.returncode != 0
    assert "TORCH_CUDA_ARCH_LIST=9.0 asks for the expert cache's CUDA library, but nvcc is not" in done.stdout + done.stderr


def test_the_sdist_carries_the_native_sources_but_no_build(tree, tmp_path):
    done = subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path)!r}))"],
                          cwd=tree, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    with tarfile.open(tmp_path / done.stdout.split()[-1]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"setup.py", "native/Makefile", "native/ec/expert_cache.cu", "native/cpu_expert/expert.cpp"} <= names
    assert not [n for n in names if n.startswith("native/build")]
