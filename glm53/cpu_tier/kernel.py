"""The CPU tier's expert kernel (``native/cpu_expert``): routed experts computed on host cores from EXL3 data.

An expert is ``out[t] += w[t] * down(min(silu(gate(x[t])), L) * clamp(up(x[t]), -L, L))`` for 1..8 tokens,
each projection an EXL3 linear with the mul1 codebook read from its on-disk tensors (``trellis`` int16
``[in/16, out/16, 16 K]``, ``suh``/``svh`` fp16), accumulated in fp32. The activation clamp is exllamav3
1.6.5's reading of GLM's ``swiglu_limit`` (the activated gate clamped from above, the up projection both ways).
Results are identical bit for bit on every ISA and for any number of threads.

Codebook values (``codebook``, :data:`CODEBOOKS`):

- ``fp16`` (the default): the fp16 weights exllamav3's GPU kernels (and its quantiser) decode, bit for bit,
  ``fp16(fma(1024 + byte sum, fp16 0x1eee, fp16 0xc931))``, which sit 476 / 2^18 (1.8e-3) below the exact
  ``(byte sum - 510) * fp16(0x1eee)`` of ``tools/synth/exl3_reference.mul1_values`` and exllamav3's own CPU
  kernel, plus their fp16 rounding;
- ``fma``: that fused multiply-add before its rounding to fp16 (relative RMS 2.1e-4 from the fp16 weights, without
  bias), which spares the rounding's three of the ten vector operations a weight costs at one token;
- ``int16``: the ``fma`` weights against each projection's input rounded to 16 bits per 128 (one scale a block),
  the products summed exactly in integers per block (per expert output 4e-5 to 5e-5 relative RMS from ``fma``'s result; on AVX-512
  with VNNI a third fewer vector operations at one token, half at four).

The CPU tier's choice is ``GLM53_CT_CODEBOOK``.

``native/cpu_expert/format.h`` has the derivation; :func:`mul1_values` exposes the values.

Arrays are NumPy arrays or CPU torch tensors, C-contiguous. Outputs are passed in (destination passing). The
shared library comes from ``$GLM53_NATIVE_BUILD``, the installed package or the source tree's ``native/build/``
(built there with ``make`` when it is missing or older than its sources); ``glm53.native.libraries`` says how. Its
structs, numbers and signatures are ``glm53.native.cpu_binding``'s, generated from ``cpu_expert.h`` and checked
against the loaded library (``glm53.native.cpu.library``).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Self

import numpy as np

from ..native import abi, cpu, libraries
from ..native.cpu import library
from ..native.cpu_binding import GLM53_CE_MAX_ROWS, glm53_ce_codebook, glm53_ce_expert, glm53_ce_isa, glm53_ce_linear

NativeBuildError = libraries.NativeBuildError  # what library() raises when it finds and builds no library
NATIVE = libraries.SOURCE
LIBRARY = NATIVE / "build" / libraries.CPU_LIBRARY  # where `make -C native` puts it
ISAS = abi.names(glm53_ce_isa, "GLM53_CE_ISA_", "GLM53_CE_ISA_COUNT")  # by id: scalar, avx2, avx512, avx512vbmi
CODEBOOKS = abi.names(glm53_ce_codebook, "GLM53_CE_CODEBOOK_", "GLM53_CE_CODEBOOK_COUNT")  # by id: fp16, fma, int16
MAX_ROWS = GLM53_CE_MAX_ROWS
# a call's projection units per thread, at least: 4 was the rule the kernel was built with (a one-expert job on the
# H200 host's 16 CPUs cost 312 us beyond its expert's 263: bench/cpu_expert_bw.py --units-per-thread measures others)
UNITS_PER_THREAD = 4
SYS_CPU = Path("/sys/devices/system/cpu")
F16, F32, I16, U16 = (np.dtype(t) for t in (np.float16, np.float32, np.int16, np.uint16))


class KernelError(ValueError):
    """The kernel refused its arguments (the message is the library's)."""


@dataclass(frozen=True)
class Linear:
    """One EXL3 linear (mul1 codebook): ``y = x @ W`` with ``W = diag(suh) H W_hat H diag(svh) / 128``."""

    trellis: object  # int16 [in/16, out/16, 16 K]
    suh: object  # fp16 [in]
    svh: object  # fp16 [out]

    @property
    def in_features(self) -> int:
        return _array(self.trellis).shape[0] * 16

    @property
    def out_features(self) -> int:
        return _array(self.trellis).shape[1] * 16


def build() -> Path:
    """Builds the library in the source tree with ``make -C native``; returns its path.

    :raise NativeBuildError: no sources, no ``make``, or the build failed (e.g. no C++ compiler).
    """
    return libraries.build_cpu(NATIVE, LIBRARY)


def locate() -> Path:
    """The library to load (``glm53.native.cpu.locate``), built in the source tree if need be.

    :raise NativeBuildError: found nowhere and not built; the message says where it looked and what to do.
    """
    return cpu.locate(NATIVE, LIBRARY)


@cache
def available_isas() -> tuple[str, ...]:
    """The kernel variants this CPU can run, slowest first (the last is the default)."""
    lib = library()
    return tuple(name for i, name in enumerate(ISAS) if lib.glm53_ce_isa_supported(i))


def _isa_id(isa: str | None) -> int:
    if isa is None:
        return -1
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}, got {isa!r}")
    if isa not in available_isas():
        raise ValueError(f"this CPU cannot run isa {isa!r}; available: {', '.join(available_isas())}")
    return ISAS.index(isa)


def codebook_id(codebook: str) -> int:
    if codebook not in CODEBOOKS:
        raise ValueError(f"codebook must be one of {', '.join(CODEBOOKS)}, got {codebook!r}")
    return CODEBOOKS.index(codebook)


def _array(a) -> np.ndarray:
    """A NumPy view of an ndarray or CPU torch tensor (same memory)."""
    if isinstance(a, np.ndarray):
        return a
    if hasattr(a, "detach") and hasattr(a, "device"):
        if a.device.type != "cpu":
            raise ValueError(f"expected a CPU tensor, got one on {a.device}")
        return a.detach().numpy()
    raise TypeError(f"expected a NumPy array or a torch tensor, got {type(a).__name__}")


def _checked(a, name: str, dtypes: tuple[np.dtype, ...], shape: tuple[int, ...] | None = None, writable: bool = False) -> np.ndarray:
    arr = _array(a)
    if arr.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(d.name for d in dtypes)}, got {arr.dtype.name}")
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{name} must be writable")
    return arr


def _c_linear(lin: Linear, name: str, keep: list) -> glm53_ce_linear:
    trellis = _checked(lin.trellis, f"{name}.trellis", (I16, U16))
    if trellis.ndim != 3 or trellis.shape[2] % 16 or not 1 <= trellis.shape[2] // 16 <= 8:
        raise ValueError(f"{name}.trellis must be [in/16, out/16, 16 K] with K in 1..8, got {trellis.shape}")
    n_in, n_out = trellis.shape[0] * 16, trellis.shape[1] * 16
    suh = _checked(lin.suh, f"{name}.suh", (F16,), (n_in,))
    svh = _checked(lin.svh, f"{name}.svh", (F16,), (n_out,))
    keep += [trellis, suh, svh]
    return glm53_ce_linear(trellis.ctypes.data, suh.ctypes.data, svh.ctypes.data, n_in, n_out, trellis.shape[2] // 16)


def _call(rc: int) -> None:
    if rc != 0:
        raise KernelError(library().glm53_ce_error().decode())


class ExpertTable:
    """Experts checked and laid out as the kernel's C table once, for calls that repeat on the same experts: a timing
    loop must not count the per-call checks and layout (about 25 us an expert, which the tier's native worker never
    pays)."""

    def __init__(self, experts: Sequence[tuple[Linear, Linear, Linear]]) -> None:
        self._keep: list = []  # the arrays the table points into
        self.table = (glm53_ce_expert * len(experts))()
        for i, (gate, up, down) in enumerate(experts):
            self.table[i] = glm53_ce_expert(_c_linear(gate, f"experts[{i}].gate", self._keep),
                                     _c_linear(up, f"experts[{i}].up", self._keep),
                                     _c_linear(down, f"experts[{i}].down", self._keep))

    def __len__(self) -> int:
        return len(self.table)


def experts_forward(x, experts: Sequence[tuple[Linear, Linear, Linear]] | ExpertTable, weights, out, *,
                    act_limit: float, isa: str | None = None, pool: Pool | None = None, codebook: str = "fp16") -> None:
    """``out[t] += sum_e weights[e, t] * expert_e(x[t])``; a zero weight skips that token for that expert.

    :param x: fp16 or fp32 ``[T, hidden]``, T in 1..8.
    :param experts: (gate, up, down) per expert, all of the same shape, or an :class:`ExpertTable` of them.
    :param weights: fp32 ``[E, T]`` router weights.
    :param out: fp32 ``[T, hidden]``, accumulated into.
    :param act_limit: GLM's ``swiglu_limit``; 0 for no clamp.
    :param isa: a name from :func:`available_isas`; None for the fastest.
    :param pool: run on this started :class:`Pool`; None for the calling thread.
    :param codebook: a name from :data:`CODEBOOKS` (see the module's docstring).
    :raise ValueError: a wrong dtype, shape or layout (the message names the argument); KernelError from the kernel.
    """
    xa = _checked(x, "x", (F16, F32))
    if xa.ndim != 2 or not 1 <= xa.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [T, hidden] with T in 1..{MAX_ROWS}, got {xa.shape}")
    rows, hidden = xa.shape
    w = _checked(weights, "weights", (F32,), (len(experts), rows))
    o = _checked(out, "out", (F32,), (rows, hidden), writable=True)
    table = experts if isinstance(experts, ExpertTable) else ExpertTable(experts)
    handle = pool.handle if pool is not None else None
    _call(library().glm53_ce_experts(handle, table.table, len(table), xa.ctypes.data, int(xa.dtype == F16), rows,
                                     w.ctypes.data, float(act_limit), o.ctypes.data, _isa_id(isa), codebook_id(codebook)))


def expert_forward(x, gate: Linear, up: Linear, down: Linear, weights, out, *, act_limit: float,
                   isa: str | None = None, pool: Pool | None = None, codebook: str = "fp16") -> None:
    """One expert: ``out[t] += weights[t] * expert(x[t])`` (weights fp32 ``[T]``); see :func:`experts_forward`."""
    w = _checked(weights, "weights", (F32,))
    experts_forward(x, [(gate, up, down)], w.reshape(1, -1), out, act_limit=act_limit, isa=isa, pool=pool, codebook=codebook)


def linear_forward(x, linear: Linear, out, *, isa: str | None = None, codebook: str = "fp16") -> None:
    """One projection on the calling thread: ``out = x @ W`` (x fp32 ``[rows, in]``, out fp32 ``[rows, out]``)."""
    keep: list = []
    lin = _c_linear(linear, "linear", keep)
    xa = _checked(x, "x", (F32,))
    if xa.ndim != 2 or xa.shape[1] != lin.in_features or xa.shape[0] < 1:
        raise ValueError(f"x must be [rows, {lin.in_features}], got {xa.shape}")
    o = _checked(out, "out", (F32,), (xa.shape[0], lin.out_features), writable=True)
    _call(library().glm53_ce_linear_forward(ctypes.byref(lin), xa.ctypes.data, xa.shape[0], o.ctypes.data, _isa_id(isa),
                                            codebook_id(codebook)))


def mul1_values(states, *, isa: str | None = None, codebook: str = "fp16") -> np.ndarray:
    """The codebook value (fp32) the kernel's projections give each 16-bit state (uint16 array), for tests."""
    s = np.ascontiguousarray(_array(states), dtype=U16)
    out = np.empty(s.shape, F32)
    _call(library().glm53_ce_mul1_values(s.ctypes.data, s.size, out.ctypes.data, _isa_id(isa), codebook_id(codebook)))
    return out


def read_bytes(buf: np.ndarray, pool: Pool | None = None) -> int:
    """Reads every byte of ``buf`` once (split over the pool's threads): the DRAM bandwidth probe of the bench."""
    arr = _checked(buf, "buf", (_array(buf).dtype,))
    return library().glm53_ce_read_bytes(pool.handle if pool is not None else None, arr.ctypes.data, arr.nbytes)


class Pool:
    """The CPU tier's worker threads, pinned to ``cpus`` (thread i to ``cpus[i % len(cpus)]``; None: not pinned).

    A thread that calls a kernel with the pool takes part in the work, so it should have a core of its own
    (:meth:`for_caller` gives it one); a caller sharing a worker's core slows both. Idle
    workers, and a caller waiting for the last units, spin ``spin_us`` microseconds, then sleep. One call at a
    time runs on a pool; calls from several threads queue. A call's projection phases are cut into at least
    ``units_per_thread`` units a thread where the columns allow (``UNITS_PER_THREAD``; no bit changes). Use ``with
    Pool(...) as pool:`` or ``start()``/``stop()``.
    """

    def __init__(self, cpus: Sequence[int] | None = None, threads: int | None = None, spin_us: int = 100,
                 units_per_thread: int = UNITS_PER_THREAD) -> None:
        self.cpus = tuple(cpus or ())
        self.threads = threads or len(self.cpus) or 1
        self.spin_us = spin_us
        self.units_per_thread = units_per_thread
        self.handle: int | None = None

    @classmethod
    def for_caller(cls, settings, spin_us: int = 100) -> tuple[Pool, int | None]:
        """``(pool, caller_cpu)`` for the threads ``GLM53_CT_CPUS`` and ``GLM53_CT_THREADS`` ask for, counting the
        thread that calls the kernels with the pool (it takes part in the work): that one gets the first CPU, the
        pool (not started) the others, one compute thread per CPU. With one CPU they share it (caller_cpu None)."""
        cpus = tier_cpus(settings.ct_cpus)
        threads = max(1, (settings.ct_threads or len(cpus)) - 1)
        if len(cpus) > 1:
            return cls(cpus[1:], threads, spin_us), cpus[0]
        return cls(cpus, threads, spin_us), None

    def start(self) -> Self:
        """:raise KernelError: a thread could not be started or pinned (e.g. a CPU outside this process's set)."""
        if self.handle is None:
            cpus = (ctypes.c_int32 * len(self.cpus))(*self.cpus)
            handle = library().glm53_ce_pool_start(cpus, len(self.cpus), self.threads, self.spin_us, self.units_per_thread)
            if not handle:
                raise KernelError(library().glm53_ce_error().decode())
            self.handle = handle
        return self

    def stop(self) -> None:
        if self.handle is not None:
            library().glm53_ce_pool_stop(self.handle)
            self.handle = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def tier_cpus(ct_cpus, allowed: Sequence[int] | None = None, sys_cpu: Path = SYS_CPU) -> tuple[int, ...]:
    """The CPUs of ``GLM53_CT_CPUS``: a given list as is; ``auto`` one CPU per physical core this process may run
    on, less the first core, which is left to the thread that feeds the GPU (when there is more than one core).
    """
    if ct_cpus != "auto":
        return tuple(ct_cpus)
    allowed = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    first_per_core: dict[tuple[str, str], int] = {}
    for cpu in allowed:
        topology = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            core = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            core = ("cpu", str(cpu))  # no topology: count every CPU as a core
        first_per_core.setdefault(core, cpu)
    cores = sorted(first_per_core.values())
    return tuple(cores[1:]) if len(cores) > 1 else tuple(cores)
