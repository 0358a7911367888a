"""The HTTP server: a Flask app factory, served by gunicorn with one gevent worker (``server/gunicorn_app.py``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

from flask import Flask, request

from ..config import Settings
from ..engine import create_backend
from ..engine.interface import Backend
from ..engine.scheduler import Scheduler
from ..progress import LoggedProgress, Progress
from . import auth, drain, errors
from .access_log import AccessLog, current_record
from .jobs import Runtime
from .metrics import Metrics

log = logging.getLogger(__name__)


def create_app(
    settings: Settings,
    backend_factory: Callable[[], Backend] | None = None,
    on_load_failure: Callable[[str], None] | None = None,
    progress: Progress | None = None,
) -> Flask:
    """Build the app and start loading the model on the scheduler's thread (the port answers meanwhile).

    :param backend_factory: makes the backend (default: the one ``settings.engine`` selects); tests pass theirs.
    :param on_load_failure: called with the reason when loading fails (gunicorn stops the server).
    :param progress: where the load reports its phases, which ``/health`` shows while loading (default: one that
        also logs them; a test's factory reports into the one it passes).
    """
    app = Flask("glm53")
    app.config["MAX_CONTENT_LENGTH"] = int(settings.max_request_mb * 1_000_000)
    app.json.sort_keys = False
    app.json.ensure_ascii = False
    progress = progress or LoggedProgress(logging.getLogger("glm53.load"))  # the load's own channel, named in the README
    scheduler = Scheduler(backend_factory or partial(create_backend, settings, progress), settings.max_queue)
    rt = Runtime(settings, scheduler, Metrics(scheduler), progress=progress)
    app.extensions["glm53"] = rt

    errors.init_app(app)
    drain.init_app(app, rt.drain)  # before auth: while draining, every client gets the same 503
    auth.init_app(app, settings.api_key)
    from . import anthropic, chat, completions, info, openapi, responses_api, sglang, web

    for module in (info, chat, completions, anthropic, responses_api, sglang, openapi, web):
        app.register_blueprint(module.bp)

    @app.after_request
    def _note_endpoint(response):
        record = current_record()
        if record is not None and request.url_rule is not None:
            record.endpoint = request.url_rule.rule
        return response

    # counted when the response is closed, with the status it ended with (a stream's can change)
    app.wsgi_app = AccessLog(app.wsgi_app, settings.log_prompts, rt.metrics.request_done)
    scheduler.start(on_failure=on_load_failure)
    return app
