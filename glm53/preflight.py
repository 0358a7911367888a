"""Checks run before the server starts (and by ``glm53 info``).

Each check gives a level (``ok``, ``warn``, ``fail``) and one sentence; a ``fail`` says what to do about it. A
failure stops ``glm53 serve`` before it binds the port; a warning does not. Nothing here initialises CUDA (the
server forks its worker after these checks): free VRAM comes from ``nvidia-smi``.

Host RAM needed, from the checkpoint's routed-expert bytes E (the sizes of its ``...mlp.experts.*`` tensors):

- ``exact``: ``1.02 * E + 6 GiB``. The host store holds every routed expert once, padded by at most 2 % for
  alignment; 6 GiB covers the rest of the process (Python, torch and the CUDA runtime's host allocations, the
  tokenizer, the loader's buffers): the reference implementation used 5.1 GB beyond one expert copy in exact
  mode (shared/notes/anchor.md, 4.5), rounded up.
- ``fast``: the same, plus what the CPU tier adds: its own copies of the experts' ``suh``/``svh`` vectors (S,
  summed from the same headers: 0.45 GB for the full model) and 64 MiB per CPU-tier thread (stack and working
  buffers; a planning figure until the tier exists and is measured). The expert store itself is not copied: the
  single copy is kept in the tier's layout.

The need is compared with MemAvailable and, inside a cgroup, with its limit minus what it already uses. Where it does
not fit, or ``GLM53_HOST_RAM_GB`` is below the store, the check says what share of the experts a RAM tier of the
bytes left (``offload.ram_budget``) holds, as a warning: the engine serves with one, reading the rest from the
checkpoint's files. It fails only below one MoE layer's experts, the least a RAM tier works with. The terms and
figures are the cost model's (``glm53.cost_model.host_ram_needed``), as ``glm53 plan`` gives them.

In fast mode, the cost model also projects what the CPU tier would take of the full model's decode on this host (its
tier threads and widest vector ISA, the GPU's PCIe link from ``nvidia-smi``): a host whose tier is projected to take
nothing gets a warning (it will rest and serve as exact mode does).

The NVIDIA driver, read from ``nvidia-smi`` too: torch and every kernel here are built with CUDA 13.2. Its own driver
branch, 595, supports it fully. The 580 branch (CUDA 13.0's) runs it through minor-version compatibility, which
loads machine code built by any CUDA 13 toolkit but cannot compile CUDA 13.2's PTX, and answers CUDA calls added
after 13.0 with cudaErrorCallRequiresNewerDriver. Older drivers cannot run CUDA 13 at all. nix/lib/driver.nix holds
the same two numbers for the NixOS side.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import platform
import resource
from dataclasses import dataclass
from pathlib import Path

from . import cost_model as cm
from . import host
from .config import GB, Settings
from .cpu_tier.kernel import tier_cpus
from .engine import cuda_gpu_visible, resolve_engine
from .models import checkpoint
from .models.download import fetch_command
from .models.safetensors_header import read_header
from .offload import ram_budget

GiB = 2**30
FAST_MODE_CPU_FLAGS = ("avx2", "fma", "f16c")
MIN_SHM = 1 * GiB
# free VRAM below this share of the total means another process holds the GPU
OTHER_PROCESS_SHARE = 0.05


SUPPORTED_ARCHITECTURE = "Glm5NextForConditionalGeneration"

DRIVER_MINIMUM = 580  # CUDA 13.0's driver branch: the oldest that runs CUDA 13 programs
DRIVER_FULL = 595  # CUDA 13.2's own branch (13.2.1 shipped 595.58.03, 13.2.2 595.71.05)


@dataclass(frozen=True)
class Check:
    name: str
    level: str  # ok | warn | fail
    message: str


def run_checks(settings: Settings, paths: host.HostPaths | None = None, query_gpus=host.query_gpus) -> list[Check]:
    """Every check for ``settings``. :param paths: where the host's figures are read (default: the real /proc,
    /sys and /dev/shm; tests pass fakes). :param query_gpus: lists the GPUs (``host.query_gpus``; tests pass a fake)."""
    paths = paths or host.HostPaths()
    engine, why = resolve_engine(settings)
    checks = [Check("engine", "ok", f"{engine}: {why}"), _python()]
    if engine != "exl3":
        return checks + [_host_ram(None, settings, paths)]
    model = _model_dir(settings)
    experts = _expert_bytes(settings.model_dir) if model.level == "ok" else None
    query_gpus = functools.cache(query_gpus)  # one nvidia-smi run answers both GPU checks
    checks += [_exllamav3(), _gpu(settings, query_gpus)]
    checks += [c for c in [_driver(query_gpus)] if c]
    checks += [model, _host_ram(experts, settings, paths), _memlock(experts), _shm(paths)]
    if settings.mode == "fast":
        checks.append(_cpu_features(paths))
        checks += [c for c in [_fast_projection(settings, paths, query_gpus)] if c]
    return checks


def failures(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.level == "fail"]


def _python() -> Check:
    return Check("python", "ok", f"Python {platform.python_version()} on {platform.machine()}")


def _exllamav3() -> Check:
    spec = importlib.util.find_spec("exllamav3")  # found without importing it (an import loads CUDA code)
    if spec is None:
        return Check("exllamav3", "fail", "exllamav3 is not installed; install the GPU extra: pip install 'glm53[gpu]'")
    return Check("exllamav3", "ok", f"exllamav3 at {Path(spec.origin).parent}")


def _gpu(settings: Settings, query_gpus) -> Check:
    if not cuda_gpu_visible():
        return Check("gpu", "fail", "no NVIDIA GPU is visible (no /dev/nvidia*, or CUDA_VISIBLE_DEVICES hides them); run on a CUDA host or use --engine tiny")
    try:
        gpus = query_gpus()
    except OSError as exc:
        return Check("gpu", "warn", f"an NVIDIA GPU is visible, but its free memory is unknown ({exc}); nvidia-smi comes with the NVIDIA driver")
    # nvidia-smi numbers GPUs in PCI order, as CUDA does with CUDA_DEVICE_ORDER=PCI_BUS_ID
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu = host.selected_gpu(gpus, visible)
    if gpu is None:
        return Check("gpu", "warn", f"nvidia-smi lists no GPU matching CUDA_VISIBLE_DEVICES={visible!r}; free VRAM unknown")
    text = (f"GPU {gpu.index} ({gpu.name}, compute capability {gpu.compute_capability}, driver {gpu.driver}): "
            f"{gpu.free / GiB:.1f} GiB free of {gpu.total / GiB:.1f} GiB")
    budget = settings.vram_limit_gb
    if budget is not None and gpu.free < budget * 1e9:
        return Check("gpu", "fail", f"{text}, below the {budget:g} GB that GLM53_VRAM_LIMIT_GB asks for; stop the processes nvidia-smi lists on it, or lower GLM53_VRAM_LIMIT_GB")
    if gpu.free < (1 - OTHER_PROCESS_SHARE) * gpu.total:
        return Check("gpu", "warn", f"{text}: other processes hold {(gpu.total - gpu.free) / GiB:.1f} GiB, which the expert cache cannot use")
    return Check("gpu", "ok", text)


def _driver(query_gpus) -> Check | None:
    """What the NVIDIA driver supports of CUDA 13.2. None where no GPU is visible or nvidia-smi does not answer: the
    gpu check says so already."""
    if not cuda_gpu_visible():
        return None
    try:
        gpus = query_gpus()
    except OSError:
        return None
    gpu = host.selected_gpu(gpus, os.environ.get("CUDA_VISIBLE_DEVICES")) or (gpus[0] if gpus else None)
    if gpu is None:
        return None
    try:
        branch = int(gpu.driver.split(".")[0])
    except ValueError:
        return Check("driver", "warn", f"cannot read the NVIDIA driver's version from {gpu.driver!r}; "
                                       f"CUDA 13.2 needs the {DRIVER_FULL} series or newer (the {DRIVER_MINIMUM} series with limits)")
    text = f"NVIDIA driver {gpu.driver}"
    if branch < DRIVER_MINIMUM:
        return Check("driver", "fail", f"{text} cannot run CUDA 13 programs (the oldest that can is the {DRIVER_MINIMUM} series): "
                                       f"torch and the kernels here are built with CUDA 13.2; install the {DRIVER_FULL} series or newer")
    if branch < DRIVER_FULL:
        return Check("driver", "warn", f"{text} runs CUDA 13.2 only through minor-version compatibility. Works: machine code built for "
                                       "this GPU (torch's kernels, exllamav3's and this project's, Triton's, which it compiles itself). "
                                       "Does not: a GPU the builds have no machine code for (the driver cannot compile CUDA 13.2's PTX), "
                                       "and CUDA calls added after 13.0 (cudaErrorCallRequiresNewerDriver). "
                                       f"The {DRIVER_FULL} series or newer supports CUDA 13.2 fully")
    return Check("driver", "ok", f"{text} supports CUDA 13.2 fully ({DRIVER_FULL} series or newer)")


def _model_dir(settings: Settings) -> Check:
    model_dir = settings.model_dir
    if not checkpoint.has_config(model_dir):
        return Check("model", "fail", f"{model_dir} holds no config.json; point -m/GLM53_MODEL_DIR at an EXL3 checkpoint, "
                                      f"set GLM53_MODEL_DOWNLOAD=1, or fetch it: {fetch_command(settings)}")
    try:
        archs = checkpoint.read_config(model_dir).get("architectures", [])
    except ValueError as exc:
        return Check("model", "fail", f"{model_dir}/config.json is not valid JSON ({exc}); re-download the checkpoint")
    if archs != [SUPPORTED_ARCHITECTURE]:
        return Check("model", "fail", f"{model_dir} holds a {', '.join(archs) or 'unnamed'} checkpoint; glm53 serves {SUPPORTED_ARCHITECTURE} (GLM-5.3-Flash) only")
    index = model_dir / "model.safetensors.index.json"
    shards = sorted(model_dir.glob("*.safetensors"))
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as exc:
            return Check("model", "fail", f"{index} is not a valid safetensors index ({exc}); re-download the checkpoint")
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            return Check("model", "fail", f"{model_dir} lacks {len(missing)} shard(s) named in its index, first {missing[0]}; finish the download")
        shards = [model_dir / n for n in names]
    if not shards:
        return Check("model", "fail", f"{model_dir} has no .safetensors files; the checkpoint is incomplete")
    short = [s.name for s in shards if not _header_fits(s)]
    if short:
        return Check("model", "fail", f"{model_dir}/{short[0]} is shorter than its header says (truncated download?); fetch it again")
    size = sum(s.stat().st_size for s in shards)
    return Check("model", "ok", f"{model_dir}: {len(shards)} shard(s), {size / 1e9:.1f} GB")


def _header_fits(path: Path) -> bool:
    """Whether a safetensors file is as long as its header's largest data offset says."""
    try:
        header, data_start = read_header(path)
    except (OSError, ValueError):
        return False
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    return path.stat().st_size >= data_start + end


def _expert_bytes(model_dir: Path) -> checkpoint.ExpertBytes | None:
    try:
        return checkpoint.expert_bytes(model_dir)
    except (OSError, ValueError, KeyError):
        return None  # the model check has said what is wrong with the files


def ram_needed(experts: checkpoint.ExpertBytes, settings: Settings) -> int:
    """Host RAM the chosen mode needs for this checkpoint (the module docstring gives the terms)."""
    return cm.host_ram_needed(experts.routed, experts.sign_scale, settings.mode, ram_budget.cpu_tier_threads(settings))


def _host_ram(experts: checkpoint.ExpertBytes | None, settings: Settings, paths: host.HostPaths) -> Check:
    avail, text = ram_budget.available(paths)
    if avail is None:
        return Check("host_ram", "warn", f"{text}; host RAM unchecked")
    if experts is None:
        return Check("host_ram", "ok", text)
    need = ram_needed(experts, settings)
    terms = f"{cm.STORE_PADDING} x {experts.routed / GiB:.1f} GiB of routed experts + {cm.PROCESS_OVERHEAD / GiB:.0f} GiB"
    if settings.mode == "fast":
        terms += f" + the CPU tier's {(need - int(cm.STORE_PADDING * experts.routed) - cm.PROCESS_OVERHEAD) / GiB:.1f} GiB"
    store = cm.STORE_PADDING * experts.routed
    budget, given = ram_budget.expert_budget(settings, experts.sign_scale, paths)
    if need <= avail and budget >= store:
        return Check("host_ram", "ok", f"{settings.mode} mode needs {need / GiB:.1f} GiB ({terms}); {text}")
    share = min(1.0, budget / store)
    if budget < experts.layer_bytes:
        return Check("host_ram", "fail", f"{settings.mode} mode holds every routed expert in {need / GiB:.1f} GiB of host RAM ({terms}) "
                                         f"but {text}; a RAM tier of {budget / GiB:.1f} GiB ({given}) does not hold one MoE layer's "
                                         f"experts ({experts.layer_bytes / GiB:.2f} GiB), which a prefill reads together: free "
                                         "memory, raise the memory limit (docker --memory, systemd MemoryMax) or GLM53_HOST_RAM_GB"
                                         + (", or use GLM53_MODE=exact" if settings.mode == "fast" else ""))
    note = (" The CPU tier computes its share of the misses where the RAM tier holds them or read them." if settings.mode == "fast" else "")
    return Check("host_ram", "warn", f"{settings.mode} mode would hold every routed expert in {need / GiB:.1f} GiB ({terms}) but "
                                     f"{text}: a RAM tier of {budget / GiB:.1f} GiB ({given}) holds {share:.0%} of the routed experts "
                                     f"and the rest are read from the checkpoint's files on a miss (decode and prefill slow to the "
                                     f"disk's rate; `glm53 plan --ram-gib` projects it).{note}")

def _memlock(experts: checkpoint.ExpertBytes | None) -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", "ok", "locked-memory limit is unlimited")
    store = f"the {cm.STORE_PADDING * experts.routed / GiB:.1f} GiB host expert store" if experts else "the host expert store"
    return Check("memlock", "warn", f"locked-memory limit is {soft / 2**20:.0f} MiB: page-locking {store} fails past it, and the GPU can read "
                                    "missed experts in place over PCIe (zero-copy) only from page-locked memory; "
                                    "set it to unlimited (ulimit -l unlimited, docker --ulimit memlock=-1, LimitMEMLOCK=infinity)")


def _shm(paths: host.HostPaths) -> Check:
    size = host.shm_bytes(paths.shm)
    if size is None:
        return Check("shm", "warn", f"{paths.shm} is missing; torch's shared-memory tensors fail without it: mount a tmpfs there")
    if size < MIN_SHM:
        return Check("shm", "warn", f"{paths.shm} holds only {size / 2**20:.0f} MiB; torch's shared-memory tensors fail with a bus error when "
                                    f"it fills: give it at least {MIN_SHM / GiB:.0f} GiB (docker --shm-size=1g)")
    return Check("shm", "ok", f"{paths.shm}: {size / GiB:.1f} GiB")


def _cpu_features(paths: host.HostPaths) -> Check:
    flags = host.cpu_flags(paths.cpuinfo)
    if flags is None:
        return Check("cpu", "warn", f"cannot read CPU flags from {paths.cpuinfo}; the CPU tier needs {', '.join(FAST_MODE_CPU_FLAGS)}")
    missing = [f for f in FAST_MODE_CPU_FLAGS if f not in flags]
    if missing:
        return Check("cpu", "fail", f"fast mode's CPU tier needs {', '.join(f.upper() for f in FAST_MODE_CPU_FLAGS)}, and this CPU lacks "
                                    f"{', '.join(f.upper() for f in missing)}; run GLM53_MODE=exact")
    return Check("cpu", "ok", f"CPU has {', '.join(f.upper() for f in FAST_MODE_CPU_FLAGS)} (fast mode's CPU tier)")


def widest_isa(flags: set[str]) -> str | None:
    """The widest of the CPU tier's kernels this CPU runs (its /proc/cpuinfo flags), None below AVX2."""
    avx512 = {"avx512f", "avx512bw", "avx512vl"} <= flags
    if avx512 and "avx512vbmi" in flags and ("avx512_vnni" in flags or "avx512vnni" in flags):
        return "avx512vbmi"
    if avx512:
        return "avx512"
    return "avx2" if {"avx2", "fma", "f16c"} <= flags else None


def _fast_projection(settings: Settings, paths: host.HostPaths, query_gpus) -> Check | None:
    """The cost model's projection of the CPU tier's share here (no measurement: the ISA's measured rate a core), over
    the server's GPU's PCIe link."""
    isa = widest_isa(host.cpu_flags(paths.cpuinfo) or set())
    if isa is None:
        return None  # the CPU check has said what is missing
    threads = ram_budget.cpu_tier_threads(settings) if settings.ct_threads or isinstance(settings.ct_cpus, tuple) else len(tier_cpus(settings.ct_cpus))
    try:
        gpu = host.selected_gpu(query_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    except OSError:
        gpu = None  # the GPU check has said why
    link = cm.pcie_link_gbs(gpu.pcie_gen, gpu.pcie_width) if gpu else None
    link, where = (link, f"{gpu.name}'s PCIe link") if link else (25.0, "a PCIe 4 x16 link (nvidia-smi gave none)")
    rig = cm.described(cm.PRESETS["pcie4-4090-7950x"], name="this host", link_gbs=link, cores=threads + 1, isa=isa, dram_gbs=1e6)
    p = cm.project(rig, cm.load_profile(cm.PROFILE), streams=(1,))
    exact, fast = p.decode_tok_s["exact"][1], p.decode_tok_s["fast"][1]
    what = (f"{threads} CPU-tier thread{'s' if threads != 1 else ''} ({isa}), {where} at {link:g} GB/s; the full model projected "
            f"at {fast:.1f} tok/s in fast mode against {exact:.1f} in exact (DRAM not counted; `glm53 plan` measures this host)")
    if fast <= 1.02 * exact:
        return Check("fast_mode", "warn", f"fast mode's CPU tier is projected to take no share of the misses here: {what}. It will rest "
                                          "and serve as exact mode does (GLM53_CT_ENABLE=auto turns it off at start when its measured costs agree)")
    return Check("fast_mode", "ok", f"the CPU tier is projected to take {p.cpu_experts_per_layer[1]:.1f} experts a layer: {what}")

