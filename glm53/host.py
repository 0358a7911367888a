"""What the host offers, read from the files the kernel exposes (and ``nvidia-smi``) without initialising CUDA:
memory, the cgroup's memory limit, CPU features, ``/dev/shm``, the GPUs' free memory. ``preflight`` judges
these figures; every reader takes its paths as parameters so that tests can hand it synthetic files.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

# cgroup v1 writes "no limit" as a huge page-aligned number rather than "max"
V1_UNLIMITED = 2**60


@dataclass(frozen=True)
class HostPaths:
    meminfo: Path = Path("/proc/meminfo")
    cpuinfo: Path = Path("/proc/cpuinfo")
    self_cgroup: Path = Path("/proc/self/cgroup")
    cgroup_root: Path = Path("/sys/fs/cgroup")
    shm: Path = Path("/dev/shm")


@dataclass(frozen=True)
class CgroupMemory:
    limit: int  # bytes the cgroup (or the tightest of its ancestors) may use
    current: int | None  # bytes it uses now, where the kernel says


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    total: int  # bytes
    free: int  # bytes
    driver: str  # the NVIDIA driver's version
    compute_capability: str  # "9.0" for an H100/H200
    pcie_gen: int | None = None  # the PCIe link's generation and width at their maximum (None: not reported)
    pcie_width: int | None = None


def meminfo(path: Path) -> dict[str, int]:
    """/proc/meminfo as bytes per field; {} when unreadable."""
    out = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields:
                out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    except (OSError, ValueError):
        return {}
    return out


def cgroup_memory(paths: HostPaths) -> CgroupMemory | None:
    """The memory limit of this process's cgroup: v2 ``memory.max`` (the lowest along the path up to the root,
    since every ancestor's limit applies), else v1 ``memory.limit_in_bytes``; None when there is no limit."""
    try:
        lines = paths.self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, rel = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            return _v2_limit(paths.cgroup_root, rel)
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = paths.cgroup_root / "memory" / rel.lstrip("/")
            limit = _read_int(base / "memory.limit_in_bytes")
            if limit is None or limit >= V1_UNLIMITED:
                return None
            return CgroupMemory(limit, _read_int(base / "memory.usage_in_bytes"))
    return None


def _v2_limit(root: Path, rel: str) -> CgroupMemory | None:
    here = root / rel.lstrip("/")
    current = _read_int(here / "memory.current")
    limits = []
    node = here
    while True:
        value = _read_int(node / "memory.max")
        if value is not None:
            limits.append(value)
        if node == root or root not in node.parents:
            break
        node = node.parent
    return CgroupMemory(min(limits), current) if limits else None


def _read_int(path: Path) -> int | None:
    """An integer file; None for "max", a missing file or junk."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def cpu_flags(path: Path) -> set[str] | None:
    """The feature flags of the first CPU in /proc/cpuinfo; None when unreadable."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return set(value.split())
    except OSError:
        return None
    return None


def shm_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def query_gpus(run=subprocess.run) -> list[Gpu]:
    """The GPUs ``nvidia-smi`` sees, in its order, with their memory, driver version, compute capability and PCIe link.

    :raise OSError: nvidia-smi is missing or failed (its message says why).
    """
    cmd = ["nvidia-smi", "--query-gpu=index,uuid,name,memory.total,memory.free,driver_version,compute_cap,pcie.link.gen.max,"
           "pcie.link.width.max", "--format=csv,noheader,nounits"]
    try:
        out = run(cmd, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        raise OSError("nvidia-smi did not answer within 20 s") from None
    if out.returncode != 0:
        raise OSError(f"nvidia-smi failed: {(out.stderr or out.stdout).strip().splitlines()[0] if (out.stderr or out.stdout).strip() else out.returncode}")
    gpus = []
    for line in out.stdout.strip().splitlines():
        index, uuid, name, total, free, driver, cc, gen, width = (f.strip() for f in line.split(","))
        gpus.append(Gpu(int(index), uuid, name, int(total) * 2**20, int(free) * 2**20, driver, cc, _count(gen), _count(width)))
    return gpus


def _count(text: str) -> int | None:
    """A number nvidia-smi reports, or None for its "[N/A]" (a virtual machine may not say)."""
    return int(text) if text.isdigit() else None


def selected_gpu(gpus: list[Gpu], cuda_visible_devices: str | None) -> Gpu | None:
    """The GPU the server will use: the first of CUDA_VISIBLE_DEVICES (an index or a UUID), else the first."""
    if not gpus:
        return None
    first = (cuda_visible_devices or "").split(",")[0].strip()
    if not first:
        return gpus[0]
    for gpu in gpus:
        if first == str(gpu.index) or gpu.uuid.startswith(first):
            return gpu
    return None
