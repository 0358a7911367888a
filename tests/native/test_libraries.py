"""Where the native libraries are looked for (override, installed package, source tree), and which CUDA library
fits which GPU, on temporary directories with stand-in files (CPU; nvcc is used where present)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from glm53.cpu_tier import kernel as cpu_expert
from glm53.cpu_tier.device import COUNTERS, CtKernels
from glm53.native import cuda
from glm53.native import libraries as native_lib
from glm53.native.libraries import NativeBuildError
from glm53.offload.ec_native import Kernels

REPO = Path(__file__).resolve().parents[2]
CPU = native_lib.CPU_LIBRARY


@pytest.fixture
def places(tmp_path, monkeypatch):
    """An override directory, an installed package and a source tree, all empty, in place of the real ones."""
    override, installed, source = tmp_path / "override", tmp_path / "site" / "glm53" / "_native", tmp_path / "src" / "native"
    for d in (override, installed, source / "build"):
        d.mkdir(parents=True)
    monkeypatch.setattr(native_lib, "INSTALLED", installed)
    monkeypatch.setattr(native_lib, "SOURCE", source)
    monkeypatch.setenv(native_lib.OVERRIDE_ENV, str(override))
    return override, installed, source


def _touch(path: Path, mtime: float = 1_000_000.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    os.utime(path, (mtime, mtime))
    return path


class Builds:
    """A stand-in build: records that it ran and writes the library into the source tree."""

    def __init__(self, out: Path, error: str | None = None):
        self.out, self.error, self.runs = out, error, 0

    def __call__(self) -> Path:
        self.runs += 1
        if self.error:
            raise NativeBuildError(self.error)
        return _touch(self.out, 3_000_000.0)


def _find(source: Path, build: Builds) -> Path:
    return native_lib.find_or_build(CPU, native_lib.named(CPU), [_touch(source / "Makefile", 2_000_000.0)], build, "FIX IT")


def test_search_order_override_then_installed_then_source_tree(places, monkeypatch):
    override, installed, source = places
    built = _touch(source / "build" / CPU, 2_500_000.0)
    build = Builds(built)
    for d in (override, installed):
        _touch(d / CPU)
    assert _find(source, build) == override / CPU
    (override / CPU).unlink()
    assert _find(source, build) == installed / CPU
    monkeypatch.delenv(native_lib.OVERRIDE_ENV)
    assert native_lib.search_dirs() == [installed, source / "build"]
    assert _find(source, build) == installed / CPU
    (installed / CPU).unlink()
    assert _find(source, build) == built
    assert build.runs == 0


def test_prebuilt_libraries_are_taken_as_they_are_but_a_stale_source_build_is_rebuilt(places):
    _, installed, source = places
    _touch(source / "build" / CPU, 1_000_000.0)  # older than the Makefile (2_000_000)
    build = Builds(source / "build" / CPU)
    assert _find(source, build) == source / "build" / CPU and build.runs == 1
    _touch(installed / CPU, 1_000_000.0)  # just as old, but an installed library has no sources to be older than
    assert _find(source, build) == installed / CPU and build.runs == 1


def test_nothing_found_without_a_source_tree_says_where_it_looked(places):
    override, installed, source = places
    _touch(override / "libother.so")
    build = Builds(source / "build" / CPU)
    with pytest.raises(NativeBuildError) as err:
        native_lib.find_or_build(CPU, native_lib.named(CPU), [source / "Makefile"], build, "FIX IT")
    message = str(err.value)
    assert f"{override} (libother.so)" in message and f"{installed} (no libraries)" in message
    assert "no source tree" in message and message.endswith("FIX IT") and build.runs == 0


def test_a_failed_build_says_where_it_looked_and_why(places):
    _, installed, source = places
    build = Builds(source / "build" / CPU, error="no compiler here")
    with pytest.raises(NativeBuildError, match=r"building one failed: no compiler here\nFIX IT") as err:
        _find(source, build)
    assert str(installed) in str(err.value) and build.runs == 1


def test_cpu_expert_looks_in_the_override_and_the_installed_package(places, monkeypatch):
    override, installed, source = places
    monkeypatch.setattr(cpu_expert, "NATIVE", source)
    monkeypatch.setattr(cpu_expert, "LIBRARY", source / "build" / CPU)
    _touch(installed / CPU)
    assert cpu_expert.locate() == installed / CPU
    _touch(override / CPU)
    assert cpu_expert.locate() == override / CPU
    for f in (override / CPU, installed / CPU):
        f.unlink()
    with pytest.raises(NativeBuildError, match=f"no source tree.*{native_lib.OVERRIDE_ENV}"):
        cpu_expert.locate()  # an installed package without its library: nothing to build from


@pytest.mark.parametrize(("arch_list", "targets"), [
    ("8.6;8.9;9.0;12.0", ["sm_86", "sm_89", "sm_90", "sm_120"]),
    ("8.6 9.0+PTX", ["sm_86", "sm_90", "compute_90"]),
    (" 9.0a ; 10.0f;9.0a", ["sm_90a", "sm_100f"]),
])
def test_cuda_targets_from_torch_arch_list(arch_list, targets):
    assert native_lib.cuda_targets(arch_list) == targets
    assert native_lib.ec_library_targets(native_lib.ec_library_name(targets)) == targets


@pytest.mark.parametrize("arch_list", ["Ampere", "9", "9.0+ptx", "sm_90", "", " ; "])
def test_cuda_targets_refuses_what_it_cannot_name(arch_list):
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST"):
        native_lib.cuda_targets(arch_list)


def test_the_nix_package_expects_the_library_this_build_makes():
    cases = json.loads((REPO / "nix" / "tests" / "golden" / "cuda-ec-library.json").read_text())
    assert cases
    for case in cases:
        assert native_lib.ec_library_name(native_lib.cuda_targets(case["archList"])) == case["library"], case


@pytest.mark.parametrize("name", [CPU, "libglm53_ec_.so", "libglm53_ec_sm_9.so", "libglm53_ec_sm_90.so.1",
                                  ".libglm53_ec_sm_90.so.123.tmp", "libglm53_ec_sm_90-Ampere.so"])
def test_other_files_are_not_expert_cache_libraries(name):
    assert native_lib.ec_library_targets(name) is None


@pytest.mark.parametrize(("target", "capability", "fit"), [
    ("sm_90", (9, 0), 3),
    ("sm_86", (8, 9), 2),  # binary compatible within a major version
    ("sm_89", (8, 6), 0),
    ("sm_80", (9, 0), 0),
    ("sm_90a", (9, 0), 3),
    ("sm_90a", (10, 0), 0),
    ("sm_100f", (10, 3), 2),
    ("compute_90", (12, 0), 1),  # PTX: the driver compiles it for a later GPU
    ("compute_90", (8, 9), 0),
    ("compute_90a", (9, 0), 1),
    ("compute_90a", (10, 0), 0),
    ("compute_100f", (10, 3), 1),
    ("compute_100f", (12, 0), 0),
])
def test_target_fit(target, capability, fit):
    assert native_lib.target_fit(target, capability) == fit


def test_pick_ec_prefers_own_machine_code_then_compatible_then_ptx():
    files = [Path(native_lib.ec_library_name(t)) for t in
             (["compute_80"], ["sm_86", "sm_89"], ["sm_90"], ["sm_120"])]
    files.append(Path(CPU))
    assert native_lib.pick_ec(files, (9, 0)) == files[2]
    assert native_lib.pick_ec(files, (8, 9)) == files[1]
    assert native_lib.pick_ec(files, (8, 7)) == files[1]  # sm_86 runs there, before compute_80's PTX
    assert native_lib.pick_ec(files, (10, 0)) == files[0]  # only PTX fits
    assert native_lib.pick_ec(files, (7, 5)) is None


@pytest.fixture
def ec_places(places, monkeypatch):
    monkeypatch.setattr(cuda, "SOURCE", places[2] / "ec" / "expert_cache.cu")
    return places


def test_ec_library_for_this_gpu_from_a_fat_installed_library(ec_places):
    override, installed, _ = ec_places
    fat = _touch(installed / "libglm53_ec_sm_86-sm_89-sm_90.so")
    assert cuda.locate((9, 0)) == fat
    assert cuda.locate((8, 6)) == fat
    own = _touch(override / "libglm53_ec_sm_90.so")
    assert cuda.locate((9, 0)) == own
    assert cuda.locate((8, 9)) == fat  # the override has nothing for it


def test_no_ec_library_for_this_gpu_says_what_was_looked_for_and_how_to_fix_it(ec_places, monkeypatch):
    _, installed, source = ec_places
    _touch(installed / "libglm53_ec_sm_86-sm_90.so")
    with pytest.raises(NativeBuildError) as err:
        cuda.locate((12, 0))
    message = str(err.value)
    for expected in ("compute capability 12.0", f"{installed} (libglm53_ec_sm_86-sm_90.so)", "no source tree",
                     "12.0 in TORCH_CUDA_ARCH_LIST", "config.cudaCapabilities", native_lib.OVERRIDE_ENV):
        assert expected in message
    _touch(source / "ec" / "expert_cache.cu")  # a source tree, but no nvcc
    monkeypatch.setattr(native_lib, "find_nvcc", lambda environ=None: None)
    with pytest.raises(NativeBuildError, match="building one failed: nvcc, which builds libglm53_ec_sm_120.so"):
        cuda.locate((12, 0))


def test_find_nvcc_looks_on_path_then_in_cuda_home(tmp_path, monkeypatch):
    monkeypatch.setattr(native_lib, "CUDA_HOME", tmp_path / "nowhere")
    home = tmp_path / "cuda"
    nvcc = _touch(home / "bin" / "nvcc")
    nvcc.chmod(0o755)
    assert native_lib.find_nvcc({"PATH": str(tmp_path)}) is None
    assert native_lib.find_nvcc({"PATH": str(tmp_path), "CUDA_HOME": str(home)}) == str(nvcc)
    assert native_lib.find_nvcc({"PATH": str(home / "bin")}) == str(nvcc)
    monkeypatch.setattr(native_lib, "CUDA_HOME", home)
    assert native_lib.find_nvcc({"PATH": str(tmp_path)}) == str(nvcc)


@pytest.mark.skipif(native_lib.find_nvcc() is None, reason="no nvcc here")
def test_ec_library_is_built_in_the_source_tree_once(ec_places):
    _, installed, source = ec_places
    shutil.copytree(REPO / "native" / "ec", cuda.SOURCE.parent)  # the source and the headers it includes
    shutil.copy(REPO / "native" / "abi.h", source / "abi.h")
    built = cuda.locate((9, 0))
    assert built == source / "build" / "libglm53_ec_sm_90.so" and built.stat().st_size > 0
    mtime = built.stat().st_mtime_ns
    assert cuda.locate((9, 0)) == built and built.stat().st_mtime_ns == mtime
    fat = native_lib.build_ec(native_lib.find_nvcc(), cuda.SOURCE, installed, native_lib.cuda_targets("8.6;9.0+PTX"))
    assert fat.name == "libglm53_ec_sm_86-sm_90-compute_90.so"
    assert cuda.locate((12, 0)) == fat  # its PTX
    assert not [p for p in installed.iterdir() if p.name.endswith(".tmp")]
    # the mirrors of its structs and numbers are checked when each binding loads it (no GPU needed for that)
    assert Kernels(built).path == built and CtKernels(built).counter_count >= len(COUNTERS)
