"""Model backends and the scheduler that drives them. ``create_backend`` picks the backend the settings ask for."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..config import Settings
from ..models.checkpoint import has_config
from ..progress import Progress
from .interface import Backend

log = logging.getLogger(__name__)


def cuda_gpu_visible() -> bool:
    """Whether an NVIDIA GPU is visible, answered without initialising CUDA in this process.

    gunicorn forks its worker from the process that asks, and CUDA does not survive a fork.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(Path("/dev").glob("nvidia[0-9]*"))


def resolve_engine(settings: Settings) -> tuple[str, str]:
    """The backend to run (``exl3`` or ``tiny``) and why."""
    if settings.engine != "auto":
        return settings.engine, f"--engine {settings.engine}"
    has_model = has_config(settings.model_dir)
    if not cuda_gpu_visible():
        return "tiny", "no CUDA GPU is visible, so the CPU demo model serves"
    if settings.model_download and not has_model:
        return "exl3", f"CUDA GPU, and the model will be downloaded into {settings.model_dir}"
    if not has_model:
        return "tiny", f"no model in {settings.model_dir} (no config.json), so the CPU demo model serves"
    return "exl3", f"CUDA GPU and model at {settings.model_dir}"


def create_backend(settings: Settings, progress: Progress | None = None) -> Backend:
    """:param progress: where loading the GPU engine's model reports its phases (the demo model loads at once)."""
    engine, why = resolve_engine(settings)
    log.info("engine %s: %s", engine, why)
    if engine == "tiny":
        from .tiny.backend import TinyBackend

        return TinyBackend(context_length=settings.cache_size, max_batch_size=settings.max_batch_size, chunk_size=settings.chunk_size)
    from .exl3.backend import Exl3Backend

    return Exl3Backend(settings, progress=progress)
