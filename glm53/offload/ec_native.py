"""ctypes binding of the expert cache's CUDA kernels (``native/ec/expert_cache.cu``), built with nvcc on first use.

The library has a plain C ABI and links the CUDA runtime dynamically, so it shares the runtime torch has
already loaded; every call takes the torch stream it runs on.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parents[2] / "native" / "ec" / "expert_cache.cu"
BUILD_DIR = Path(os.environ.get("GLM53_NATIVE_BUILD", SOURCE.parents[1] / "build"))
MAX_ADMIT = 16  # EC_MAX_ADMIT in the kernel source
MAX_EXPERTS = 512


class EcState(ctypes.Structure):
    """Mirror of ``struct EcState`` (the kernels read it by value)."""

    _fields_ = [
        ("num_layers", ctypes.c_int),
        ("num_experts", ctypes.c_int),
        ("freq", ctypes.c_void_p),
        ("slot_of", ctypes.c_void_p),
        ("owner", ctypes.c_void_p),
        ("picks", ctypes.c_void_p),
        ("counters", ctypes.c_void_p),
        ("home", ctypes.c_void_p),
        ("slot_addr", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("off_up", ctypes.c_int64),
        ("off_down", ctypes.c_int64),
        ("jobs", ctypes.c_void_p),
        ("num_jobs", ctypes.c_void_p),
    ]


class NativeBuildError(RuntimeError):
    pass


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def build(arch: str | None = None) -> Path:
    """Compile the library for this GPU's architecture (once; the file name carries the architecture).

    :raise NativeBuildError: no nvcc, or the compile failed (its output is in the message).
    """
    arch = arch or _arch()
    out = BUILD_DIR / f"libglm53_ec_{arch}.so"
    if out.is_file() and out.stat().st_mtime >= SOURCE.stat().st_mtime:
        return out
    nvcc = shutil.which("nvcc") or next((str(p) for p in (Path("/usr/local/cuda/bin/nvcc"),) if p.is_file()), None)
    if nvcc is None:
        raise NativeBuildError(f"the expert cache's CUDA kernels need nvcc to build {out.name} from {SOURCE}; install the CUDA toolkit or put a prebuilt library at {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [nvcc, "-O3", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared", "-o", str(tmp), str(SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NativeBuildError(f"{' '.join(cmd)} failed:\n{proc.stdout}{proc.stderr}")
    tmp.replace(out)
    return out


class Kernels:
    """The loaded library."""

    def __init__(self, path: Path | None = None):
        self.path = path or build()
        lib = ctypes.CDLL(str(self.path))
        lib.ec_struct_size.restype = ctypes.c_int
        if lib.ec_struct_size() != ctypes.sizeof(EcState):
            raise NativeBuildError(f"{self.path}: EcState is {lib.ec_struct_size()} bytes there, {ctypes.sizeof(EcState)} here; rebuild it")
        p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        lib.ec_step.argtypes = [ctypes.POINTER(EcState), i, p, i, f, f, i, i64, i, p]
        lib.ec_assign.argtypes = [ctypes.POINTER(EcState), p, i, p]
        lib.ec_read_probe.argtypes = [p, i64, p, i, p]
        for fn in (lib.ec_step, lib.ec_assign, lib.ec_read_probe):
            fn.restype = ctypes.c_int
        self._lib = lib

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what}: CUDA error {code}")

    def step(self, state: EcState, layer: int, sel: torch.Tensor, decay: float, hysteresis: float, max_admit: int, block_bytes: int, copy_blocks: int) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.ec_step(ctypes.byref(state), layer, sel.data_ptr(), sel.numel(), decay, hysteresis, max_admit, block_bytes, copy_blocks, stream), "ec_step")

    def assign(self, state: EcState, entries: torch.Tensor) -> None:
        """entries: int32 [n, 3] (layer row, expert, slot or -1) on the device."""
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.ec_assign(ctypes.byref(state), entries.data_ptr(), entries.shape[0], stream), "ec_assign")

    def read_probe(self, src: torch.Tensor, out: torch.Tensor, blocks: int) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        self._check(self._lib.ec_read_probe(src.data_ptr(), src.numel() * src.element_size(), out.data_ptr(), blocks, stream), "ec_read_probe")
