"""Read-only endpoints: ``/health``, ``/v1/models``, ``/stats``, ``/server_info``, ``/model_info``, ``/metrics``."""

from __future__ import annotations

from flask import Blueprint, Response, request

from .. import __version__
from .errors import APIError, json_error
from .jobs import runtime

bp = Blueprint("info", __name__)


@bp.get("/health")
def health():
    """200 ``{"status": "ok"}`` when the model is loaded; 503 with ``loading`` (and the load's ``phase`` and
    ``progress``, the fraction of that phase done, with its amounts, rate and ETA) or ``failed`` before, and with
    ``draining`` after a SIGTERM (in-flight requests are finishing; new ones are refused)."""
    rt = runtime()
    sched = rt.scheduler
    if rt.drain.active:
        return {"status": "draining"}, 503, {"Retry-After": "5"}
    if sched.state == "ready":
        return {"status": "ok"}
    body = {"status": sched.state}
    if sched.state == "loading":
        body.update(rt.progress.snapshot())
    if sched.error:
        body["error"] = sched.error
    return body, 503


def _model_card() -> dict:
    rt = runtime()
    card = {"id": rt.settings.served_name, "object": "model", "created": int(rt.started), "owned_by": "glm53"}
    if rt.scheduler.state == "ready":
        card["max_model_len"] = rt.scheduler.backend.info.context_length
    return card


@bp.get("/v1/models")
def models():
    return {"object": "list", "data": [_model_card()]}


@bp.get("/v1/models/<path:model_id>")
def model(model_id: str):
    if model_id != runtime().settings.served_name:
        return json_error(APIError(404, f"model {model_id!r} does not exist", param="model", code="model_not_found"))
    return _model_card()


@bp.get("/stats")
def stats():
    rt = runtime()
    sched = rt.scheduler
    return {
        "requests": rt.metrics.snapshot(),
        "scheduler": sched.snapshot(),
        "engine": sched.backend.stats() if sched.state == "ready" else None,
        "process": rt.metrics.process(),
    }


@bp.get("/server_info")
def server_info():
    """Effective settings (secrets redacted), where each came from, the model's facts (``loaded_model``) and, once
    it is loaded, the GPU it runs on (``gpu``: null for the CPU demo model)."""
    rt = runtime()
    sched = rt.scheduler
    s = rt.settings
    body = {
        "version": __version__,
        "served_name": s.served_name,
        "state": sched.state,
        "settings": s.public(),
        "setting_sources": dict(s.sources),
        "load_seconds": sched.load_seconds,
        # SGLang-style fields that generic clients and bench/sweep.py read; sglang-router takes a worker's model id
        # from served_model_name (and fails to read the whole body when ``model`` is not a string: hence loaded_model)
        "served_model_name": s.served_name,
        "model_path": s.served_name,
        "max_running_requests": s.max_batch_size,
        "chunked_prefill_size": s.chunk_size,
    }
    if sched.state == "ready":
        info = sched.backend.info
        body.update(
            context_length=info.context_length,
            max_total_num_tokens=info.context_length,
            loaded_model={"name": info.name, "architecture": info.architecture, "vocab_size": info.vocab_size,
                   "eos_token_ids": sorted(info.eos_token_ids), "chat_template": rt.template().origin,
                   **info.facts},
            gpu=dict(info.gpu) if info.gpu is not None else None,
        )
    return body


@bp.get("/model_info")
def model_info():
    """SGLang's model facts, which its router (``sglang-router``) reads when a worker registers: the served name is
    the model id it routes requests for and lists at its own ``/v1/models``."""
    rt = runtime()
    name = rt.settings.served_name
    return {"model_path": name, "tokenizer_path": name, "served_model_name": name, "is_generation": True,
            "model_type": "glm_moe", "architectures": ["Glm4MoeForCausalLM"]}


@bp.get("/metrics")
def metrics():
    """Prometheus metrics, in the exposition format the ``Accept`` header prefers: OpenMetrics 1.0
    (``application/openmetrics-text``), the text format 1.0 (``text/plain; version=1.0.0``), else the text format
    0.0.4."""
    body, content_type = runtime().metrics.exposition(request.headers.get("Accept"))
    return Response(body, content_type=content_type)
