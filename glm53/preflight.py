"""Checks run before the server starts (and by ``glm53 info``).

Each check gives a level (``ok``, ``warn``, ``fail``) and one sentence; a ``fail`` says what to do about it. A
failure stops ``glm53 serve`` before it binds the port; a warning does not. Nothing here initialises CUDA (the
server forks its worker after these checks).
"""

from __future__ import annotations

import importlib.util
import json
import platform
import resource
from dataclasses import dataclass
from pathlib import Path

from .config import Settings
from .engine import cuda_gpu_visible, resolve_engine
from .models.download import fetch_command


SUPPORTED_ARCHITECTURE = "Glm5NextForConditionalGeneration"


@dataclass(frozen=True)
class Check:
    name: str
    level: str  # ok | warn | fail
    message: str


def run_checks(settings: Settings) -> list[Check]:
    engine, why = resolve_engine(settings)
    checks = [Check("engine", "ok", f"{engine}: {why}"), _python()]
    if engine == "exl3":
        checks += [_exllamav3(), _gpu(), _model_dir(settings), _memlock()]
    checks.append(_host_ram())
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


def _gpu() -> Check:
    if cuda_gpu_visible():
        return Check("gpu", "ok", "an NVIDIA GPU is visible")
    return Check("gpu", "fail", "no NVIDIA GPU is visible (no /dev/nvidia*, or CUDA_VISIBLE_DEVICES hides them); run on a CUDA host or use --engine tiny")


def _model_dir(settings: Settings) -> Check:
    model_dir = settings.model_dir
    if not (model_dir / "config.json").is_file():
        return Check("model", "fail", f"{model_dir} holds no config.json; point -m/GLM53_MODEL_DIR at an EXL3 checkpoint, "
                                      f"set GLM53_MODEL_DOWNLOAD=1, or fetch it: {fetch_command(settings)}")
    try:
        archs = json.loads((model_dir / "config.json").read_text()).get("architectures", [])
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
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return False
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    return path.stat().st_size >= 8 + n + end


def _memlock() -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY:
        return Check("memlock", "ok", "locked-memory limit is unlimited")
    return Check("memlock", "warn", f"locked-memory limit is {soft / 2**20:.0f} MiB; pinning host RAM for the experts may fail or be slow: set it to unlimited (ulimit -l unlimited, LimitMEMLOCK=infinity)")


def _host_ram() -> Check:
    avail = _meminfo().get("MemAvailable")
    limit = _cgroup_limit()
    if avail is None:
        return Check("host_ram", "warn", "cannot read /proc/meminfo")
    text = f"{avail / 2**30:.1f} GiB available"
    if limit is not None:
        text += f", cgroup limit {limit / 2**30:.1f} GiB"
    return Check("host_ram", "ok", text)


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _cgroup_limit() -> int | None:
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)
