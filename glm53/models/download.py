"""Fetch the pinned checkpoint into the model directory (``GLM53_MODEL_DOWNLOAD=1``).

``huggingface_hub`` downloads into ``local_dir`` with resumable transfers and a progress bar, verifying each
file against the hub's hashes; a stopped download picks up where it left off on the next start.
"""

from __future__ import annotations

from ..config import Settings
from .checkpoint import has_config


class DownloadError(RuntimeError):
    """The checkpoint could not be fetched; the message names the directory and the command to fetch it."""


def fetch_command(settings: Settings) -> str:
    return f"huggingface-cli download {settings.model_repo} --revision {settings.model_revision} --local-dir {settings.model_dir}"


def needs_download(settings: Settings) -> bool:
    return settings.model_download and not has_config(settings.model_dir)


def download_checkpoint(settings: Settings) -> None:
    """:raise DownloadError: huggingface_hub missing, the hub unreachable, or the repo/revision unknown."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise DownloadError("GLM53_MODEL_DOWNLOAD=1 needs huggingface_hub: pip install 'glm53[hub]'") from None
    settings.model_dir.mkdir(parents=True, exist_ok=True)
    try:
        snapshot_download(repo_id=settings.model_repo, revision=settings.model_revision, local_dir=settings.model_dir)
    except Exception as exc:  # noqa: BLE001 - network, auth and hub errors all end the start with one sentence
        raise DownloadError(
            f"could not download {settings.model_repo}@{settings.model_revision} into {settings.model_dir} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
            f"fetch it by hand with: {fetch_command(settings)}"
        ) from None
