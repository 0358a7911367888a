"""``/health`` while the model loads: 503 with the load's phase and progress, then 200 (Flask test client over
the app, with a backend factory that reports phases and waits for the test)."""

from __future__ import annotations

import threading

from glm53 import config
from glm53.progress import Progress
from glm53.server import create_app
from tests.fakes import ScriptedBackend


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_health_shows_the_load_phase_and_its_progress_until_ready():
    clock = Clock()
    progress = Progress(clock)
    reported, release = threading.Event(), threading.Event()

    def slow_load():
        progress.phase("reading shards", total=8e9)
        clock.now = 4.0
        progress.update(2e9)
        reported.set()
        release.wait(30)
        progress.finish()
        return ScriptedBackend()

    app = create_app(config.load([], {}), backend_factory=slow_load, progress=progress)
    client = app.test_client()
    try:
        assert reported.wait(30)
        resp = client.get("/health")
        assert resp.status_code == 503
        assert resp.get_json() == {"status": "loading", "phase": "reading shards", "progress": 0.25, "done": 2e9, "total": 8e9,
                                   "unit": "B", "rate_per_s": 5e8, "eta_s": 12.0}
        release.set()
        while client.get("/health").status_code != 200:
            pass
        assert client.get("/health").get_json() == {"status": "ok"}
    finally:
        release.set()
        app.extensions["glm53"].scheduler.stop()
