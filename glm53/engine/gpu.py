"""What a GPU backend tells ``/server_info`` about its device: name, memory, compute capability, and the driver
and CUDA versions. Read once at load, in the process that runs the model (CUDA is initialised there by then).
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

# The kernel module's version is the driver's: "NVRM version: NVIDIA UNIX [Open Kernel Module for] x86_64  580.159.04  ..."
NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")


def device_facts(device: int) -> dict[str, object]:
    """Facts about CUDA device ``device`` (an index as this process numbers them)."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return {
        "index": device,
        "name": props.name,
        "total_memory_gb": round(props.total_memory / 1e9, 2),
        "compute_capability": f"{props.major}.{props.minor}",
        "multiprocessors": props.multi_processor_count,
        "driver_version": nvidia_driver_version(),
        "cuda_driver_version": cuda_driver_version(),  # the newest CUDA the driver supports
        "cuda_runtime_version": torch.version.cuda,  # the CUDA torch was built with
    }


def nvidia_driver_version(path: Path = NVIDIA_DRIVER_FILE) -> str | None:
    """The NVIDIA driver's version (``580.159.04``), or None where the kernel does not expose it."""
    try:
        text = path.read_text()
    except OSError:
        return None
    match = re.search(r"^NVRM version:.*?\s(\d+\.\d+(?:\.\d+)*)\s", text + " ", re.MULTILINE)
    return match.group(1) if match else None


def cuda_driver_version(library: str = "libcuda.so.1") -> str | None:
    """The CUDA version the driver supports (``cuDriverGetVersion``, e.g. ``13.0``), or None without a driver."""
    try:
        cuda = ctypes.CDLL(library)
    except OSError:
        return None
    version = ctypes.c_int()
    if cuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return f"{version.value // 1000}.{version.value % 1000 // 10}"
