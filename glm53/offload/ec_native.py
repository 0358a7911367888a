"""ctypes binding of the expert cache's CUDA kernels (``native/ec/expert_cache.cu``).

The library comes from ``$GLM53_NATIVE_BUILD``, the installed package (built for the GPUs the package was built
for) or the source tree's ``native/build/`` (compiled there with nvcc for this GPU on first use); ``native_lib``
says how. It has a plain C ABI and links the CUDA runtime dynamically, so it shares the runtime torch has already
loaded; every call takes the torch stream it runs on.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..native import libraries as native_lib
from ..native.libraries import NativeBuildError

SOURCE = native_lib.SOURCE / "ec" / "expert_cache.cu"
HEADERS = ("cpu_tier_device.cuh", "link_load.cuh")  # included by SOURCE (a library older than any of them is stale)
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


def sources() -> list[Path]:
    """What the library is built from."""
    return [SOURCE, *(SOURCE.with_name(h) for h in HEADERS)]


def build(target: str) -> Path:
    """Compiles the library for one nvcc target (``sm_90``) into the source tree's ``native/build/``.

    :raise NativeBuildError: no nvcc, or the compile failed (its output is in the message).
    """
    nvcc = native_lib.find_nvcc()
    if nvcc is None:
        raise NativeBuildError(f"nvcc, which builds {native_lib.ec_library_name([target])} from {SOURCE}, is not on PATH, "
                               "in $CUDA_HOME/bin or in /usr/local/cuda/bin")
    return native_lib.build_ec(nvcc, SOURCE, native_lib.SOURCE / "build", [target])


def locate(capability: tuple[int, int] | None = None) -> Path:
    """The library for a GPU of ``capability`` (default: the current device's), built in the source tree if need be.

    :raise NativeBuildError: none fits and none could be built; the message says where it looked and what to do.
    """
    major, minor = capability or torch.cuda.get_device_capability()
    target = f"sm_{major}{minor}"
    fix = (f"To fix: install the CUDA toolkit (nvcc) and, for an installed package, rebuild it with {major}.{minor} in "
           f"TORCH_CUDA_ARCH_LIST (Nix: nixpkgs' config.cudaCapabilities); or put a library built for this GPU in "
           f"${native_lib.OVERRIDE_ENV}, e.g. `nvcc -O3 -arch={target} -shared -Xcompiler -fPIC -cudart shared "
           f"-o {native_lib.ec_library_name([target])} native/ec/expert_cache.cu`.")
    return native_lib.find_or_build(f"expert-cache CUDA library ({native_lib.EC_PREFIX}*.so) for compute capability {major}.{minor}",
                                    lambda files: native_lib.pick_ec(files, (major, minor)), sources(), lambda: build(target), fix)


class Kernels:
    """The loaded library."""

    def __init__(self, path: Path | None = None):
        self.path = path or locate()
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
        self.ct = CtKernels(lib, self.path)

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


class CtRing(ctypes.Structure):
    """Mirror of ``struct CtRing`` (``native/ec/cpu_tier_device.cuh``): a CPU-tier ring's device address and geometry."""

    _fields_ = [("base", ctypes.c_void_p)] + [(n, ctypes.c_uint32) for n in ("slots", "hidden", "max_tokens", "max_picks")] + \
               [(n, ctypes.c_uint64) for n in ("slot_bytes", "slots_offset", "picks_offset", "x_offset", "out_offset")]


class CtKernels:
    """The CPU tier's device-side kernels in the same library (see ``glm53.offload.ct_device``)."""

    def __init__(self, lib, path: Path):
        lib.ct_struct_size.restype = ctypes.c_int
        if lib.ct_struct_size() != ctypes.sizeof(CtRing):
            raise NativeBuildError(f"{path}: CtRing is {lib.ct_struct_size()} bytes there, {ctypes.sizeof(CtRing)} here; rebuild it")
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        lib.ct_publish.argtypes = [ctypes.POINTER(CtRing), p, i, i, p, i, p, p, p, p]
        lib.ct_collect.argtypes = [ctypes.POINTER(CtRing), p, i64, p, i64, i64, p, p, i, i, p, p]
        lib.ct_device_pointer.argtypes = [p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)]
        lib.ct_split_publish.argtypes = [ctypes.POINTER(CtRing), p, i, i, i, p, p, p, p, p, p, i, i, i, p, p, p, p, p]
        lib.ct_fallback_plan.argtypes = [p, p, p, i, i, i, p, p, p, p, p]
        for fn in (lib.ct_publish, lib.ct_collect, lib.ct_device_pointer, lib.ct_split_publish, lib.ct_fallback_plan,
                   lib.ct_counter_count, lib.ct_record_size):
            fn.restype = ctypes.c_int
        self.counter_count, self.record_size = lib.ct_counter_count(), lib.ct_record_size()
        self._lib = lib

    def device_pointer(self, host_address: int) -> tuple[int, bool]:
        """(device address of registered host memory, whether the link does atomics on host memory natively)."""
        dev, native = ctypes.c_void_p(), ctypes.c_int(0)
        Kernels._check(self._lib.ct_device_pointer(ctypes.c_void_p(host_address), ctypes.byref(dev), ctypes.byref(native)), "ct_device_pointer")
        return int(dev.value), bool(native.value)

    def publish(self, ring: CtRing, next_seq: torch.Tensor, layer: int, x: torch.Tensor, picks: torch.Tensor,
                status: torch.Tensor, counters: torch.Tensor) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        Kernels._check(self._lib.ct_publish(ctypes.byref(ring), next_seq.data_ptr(), layer, x.shape[0], picks.data_ptr(), picks.shape[0],
                                            x.data_ptr(), status.data_ptr(), counters.data_ptr(), stream), "ct_publish")

    def collect(self, ring: CtRing, status: torch.Tensor, timeout_ns: int, outcome: torch.Tensor, acc: torch.Tensor,
                add_blocks: int, counters: torch.Tensor, info: torch.Tensor | None = None, per_expert_ns: int = 0,
                floor_ns: int = 0) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        Kernels._check(self._lib.ct_collect(ctypes.byref(ring), status.data_ptr(), timeout_ns, None if info is None else info.data_ptr(),
                                            per_expert_ns, floor_ns, outcome.data_ptr(), acc.data_ptr(), acc.shape[0], add_blocks,
                                            counters.data_ptr(), stream), "ct_collect")

    def split_publish(self, ring: CtRing, next_seq: torch.Tensor, layer: int, sel: torch.Tensor, rw: torch.Tensor,
                      y: torch.Tensor, slot_of: torch.Tensor, freq: torch.Tensor, table: torch.Tensor, probe_k: int,
                      status: torch.Tensor, counters: torch.Tensor, info: torch.Tensor, record: torch.Tensor) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        T, topk = sel.shape
        Kernels._check(self._lib.ct_split_publish(
            ctypes.byref(ring), next_seq.data_ptr(), layer, T, topk, sel.data_ptr(), rw.data_ptr(), y.data_ptr(),
            slot_of.data_ptr(), freq.data_ptr(), table.data_ptr(), table.shape[0] - 1, table.shape[1] - 1, probe_k,
            status.data_ptr(), counters.data_ptr(), info.data_ptr(), record.data_ptr(), stream), "ct_split_publish")

    def fallback_plan(self, status: torch.Tensor, outcome: torch.Tensor, record: torch.Tensor, n: int, topk: int,
                      count: torch.Tensor, token_sorted: torch.Tensor, weight_sorted: torch.Tensor,
                      counters: torch.Tensor) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        Kernels._check(self._lib.ct_fallback_plan(
            status.data_ptr(), outcome.data_ptr(), record.data_ptr(), n, topk, count.shape[0] - 1, count.data_ptr(),
            token_sorted.data_ptr(), weight_sorted.data_ptr(), counters.data_ptr(), stream), "ct_fallback_plan")
