"""The Python halves of nix/ci/check.sh's eval and wheels tiers, on made-up inputs where the tiers themselves only see
the real ones: what eval_warnings.py counts as a warning, and what wheel_deps.py accepts as provided."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

CI = Path(__file__).resolve().parents[1] / "nix" / "ci"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, CI / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


eval_warnings = load("eval_warnings")
wheel_deps = load("wheel_deps")

ON_PURPOSE = "The appliance has no SSH key for root, so nobody can log in.\nExtend it (see the README).\n"


def test_warnings_are_whole_messages_and_only_those_on_purpose_pass(tmp_path):
    stderr = ("evaluation warning: The appliance has no SSH key for root, so nobody can log in.\n"
              "                    Extend it (see the README).\n"
              "evaluation warning: cudaPackages.cuda_cccl is deprecated, use cccl instead\n"
              "trace: something traced\n")
    assert eval_warnings.messages(stderr) == [ON_PURPOSE.strip(), "cudaPackages.cuda_cccl is deprecated, use cccl instead",
                                             "something traced"]
    result = {"packages": {"a": "/nix/store/aaaa-a.drv"},
              "configurations": {"appliance": {"toplevel": "/nix/store/bbbb-b.drv", "warnings": [ON_PURPOSE],
                                               "onPurpose": ["has no SSH key for root"]}},
              "wheels": {}}
    (tmp_path / "eval.json").write_text(json.dumps(result))
    (tmp_path / "eval.err").write_text(stderr)
    assert eval_warnings.main(["", str(tmp_path / "eval.json"), str(tmp_path / "eval.err")]) == 1
    (tmp_path / "eval.err").write_text(stderr.split("evaluation warning: cuda")[0])
    assert eval_warnings.main(["", str(tmp_path / "eval.json"), str(tmp_path / "eval.err")]) == 0


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> Path:
    """Two real x86-64 shared libraries: libfoo.so.1, and libbar.so.1, which NEEDs it and libm.so.6."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler: make test installs g++ (.ci/run) for the CPU tier's kernels")
    d = tmp_path_factory.mktemp("libs")
    (d / "foo.c").write_text("int foo(void) { return 1; }\n")
    (d / "bar.c").write_text("int foo(void);\nint bar(void) { return foo(); }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libfoo.so.1", "-o", d / "libfoo.so.1", d / "foo.c"], check=True)
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,--no-as-needed", "-o", d / "libbar.so.1", d / "bar.c", d / "libfoo.so.1",
                    "-lm"], check=True)
    return d


def wheel(path: Path, members: dict[str, bytes]) -> str:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return str(path)


def test_reads_needed_from_inside_a_wheel(tmp_path, libs):
    w = wheel(tmp_path / "bar-1-cp313-cp313-linux_x86_64.whl",
              {"bar/libbar.so.1": (libs / "libbar.so.1").read_bytes(), "bar/__init__.py": b"", "bar/data.bin": b"\0" * 100})
    found = wheel_deps.elf_files(w)
    assert list(found) == ["bar/libbar.so.1"]
    assert {"libfoo.so.1", "libm.so.6", "libc.so.6"} <= set(found["bar/libbar.so.1"])


def test_every_needed_library_must_be_provided(tmp_path, libs):
    bar, foo = (libs / "libbar.so.1").read_bytes(), (libs / "libfoo.so.1").read_bytes()
    files = {"whole.whl": wheel(tmp_path / "whole.whl", {"bar/libbar.so.1": bar, "bar/libfoo.so.1": foo}),
             "half.whl": wheel(tmp_path / "half.whl", {"bar/libbar.so.1": bar}),
             "foo-cuda.whl": wheel(tmp_path / "foo-cuda.whl", {"nvidia/foo/lib/libfoo.so.1": foo,
                                                               "nvidia/foo/lib/libfoo_other.so.1": foo})}

    def wheels(packages):
        return {"packages": packages, "cudaPackages": {},
                "cudaWheelLibs": {"nvidia-foo": {"wheel": "foo-cuda.whl", "dir": "foo", "files": ["libfoo.so.1"],
                                                 "inputs": ["gcc"], "ignore": []}}}

    ok, count, _ = wheel_deps.check_autopatchelf(wheels({"whole": {"wheel": "whole.whl", "inputs": ["gcc"], "ignore": []},
                                                         "linked": {"wheel": "half.whl", "inputs": ["nvidia-foo"], "ignore": []}}),
                                                 files.__getitem__)
    assert ok == [] and count == 4  # the CUDA wheel's layout installs one of its two libraries
    problems, _, _ = wheel_deps.check_autopatchelf(wheels({"half": {"wheel": "half.whl", "inputs": ["gcc"], "ignore": []}}),
                                                   files.__getitem__)
    assert problems == ["half.whl: bar/libbar.so.1 needs libfoo.so.1, which neither the wheel, its build inputs (gcc) nor "
                        "glibc provides"]
    problems, _, _ = wheel_deps.check_autopatchelf(
        wheels({"half": {"wheel": "half.whl", "inputs": ["python"], "ignore": ["libfoo.so.1"]}}), files.__getitem__)
    assert problems == ["half: build inputs whose libraries the dry run does not know: python",
                        "half: leaves libfoo.so.1 missing, not a driver library"]


CATALOG = '''
@dataclass(frozen=True, slots=True)
class DescriptorSpec:
    name: str
    packaged_with: PackagedWith
    linux_sonames: tuple[str, ...] = ()
    anchor_rel_dirs_linux: tuple[str, ...] = ("lib64", "lib")

DESCRIPTOR_CATALOG = (
    DescriptorSpec(name="cudart", packaged_with="ctk", linux_sonames=("libcudart.so.13",)),
    DescriptorSpec(name="nvvm", packaged_with="ctk", linux_sonames=("libnvvm.so.4",), anchor_rel_dirs_linux=("nvvm/lib64",)),
    DescriptorSpec(name="nvml", packaged_with="driver", linux_sonames=("libnvidia-ml.so.1",)),
)
'''
SEARCH = "def _find_under_anchor_root(ctx, root, found_via): ...\nEARLY = (a, b)\n"


def test_cuda_bindings_libraries_must_be_where_pathfinder_looks(tmp_path):
    files = {
        "pf.whl": wheel(tmp_path / "pf.whl", {"cuda/pathfinder/_dynamic_libs/descriptor_catalog.py": CATALOG.encode(),
                                              "cuda/pathfinder/_dynamic_libs/search_steps.py": SEARCH.encode()}),
        "cb.whl": wheel(tmp_path / "cb.whl", {f"cuda/bindings/_internal/{m}.cpython-313-x86_64-linux-gnu.so": b""
                                              for m in ("runtime", "nvvm", "nvml", "utils")}),
        "tr.whl": wheel(tmp_path / "tr.whl", {"triton/backends/nvidia/driver.py": b"libs = ldconfig()\n"}),
    }
    wheels = {"triton": {"wheel": "tr.whl", "file": "triton/backends/nvidia/driver.py", "text": "libs = ldconfig()"},
              "cuda-pathfinder": {"wheel": "pf.whl", "bindings": "cb.whl",
                                  "search": {"file": "cuda/pathfinder/_dynamic_libs/search_steps.py",
                                             "text": "EARLY = (a, b)", "uses": "def _find_under_anchor_root("},
                                  "libraries": {"cudart": {"package": "cuda_cudart", "dir": "lib", "files": "libcudart*.so*"},
                                                "nvvm": {"package": "libnvvm", "dir": "nvvm/lib64", "files": "libnvvm*.so*"}},
                                  "elsewhere": {"nvml": "the driver's"}}}
    problems, summary = wheel_deps.check_loaders(wheels, files.__getitem__)
    assert problems == [] and summary == "cuda-bindings binds 3 libraries: cudart, nvvm from the store, nvml not"

    finder = wheels["cuda-pathfinder"]
    finder["libraries"]["nvvm"]["dir"] = "lib"
    del finder["elsewhere"]["nvml"]
    wheels["triton"]["text"] = "libs = subprocess.check_output()"
    problems, _ = wheel_deps.check_loaders(wheels, files.__getitem__)
    assert problems == [
        "triton.nix replaces 'libs = subprocess.check_output()' in triton/backends/nvidia/driver.py, which tr.whl holds 0 times",
        "cuda-bindings binds nvml (libnvidia-ml.so.1, packaged with the driver), which cuda-pathfinder.nix neither links "
        "into its root nor names as taken elsewhere",
        "cuda-bindings binds nvvm (libnvvm.so.4): cuda-pathfinder.nix links it under lib, pathfinder looks under nvvm/lib64",
    ]
