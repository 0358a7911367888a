"""Progress of long work: the shared state, the log lines the server writes while loading, the terminal bar."""

from __future__ import annotations

import io
import logging

import pytest

from glm53.progress import LoggedProgress, Progress, TerminalProgress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_snapshot_has_the_phase_fraction_rate_and_eta():
    clock = Clock()
    p = Progress(clock)
    assert p.snapshot() == {"phase": None, "progress": None}
    p.phase("reading shards", total=10e9)
    clock.now += 4
    p.update(2e9)
    assert p.snapshot() == {"phase": "reading shards", "progress": 0.2, "done": 2e9, "total": 10e9, "unit": "B",
                            "rate_per_s": 5e8, "eta_s": 16.0}
    p.phase("building the cache")  # no total: no fraction, no ETA
    assert p.snapshot() == {"phase": "building the cache", "progress": None, "done": 0, "total": None, "unit": "B",
                            "rate_per_s": None, "eta_s": None}
    p.finish()
    assert p.snapshot() == {"phase": None, "progress": None}


def test_steps_adapts_a_done_total_callback():
    p = Progress(Clock())
    report = p.steps("loading the model", "modules")
    report(0, 40)
    report(10, 40)
    assert (p.snapshot()["phase"], p.snapshot()["done"], p.snapshot()["total"], p.snapshot()["progress"]) == ("loading the model", 10, 40, 0.25)


def test_log_lines_at_the_start_every_interval_and_at_the_end(caplog):
    caplog.set_level(logging.INFO, logger="test.load")
    clock = Clock()
    p = LoggedProgress(logging.getLogger("test.load"), interval_s=5.0, clock=clock)
    p.phase("reading shards", total=12e9)
    for second in range(1, 13):
        clock.now += 1
        p.update(second * 1e9)
    report = p.steps("warming up", "passes")
    for done in range(4):
        report(done, 3)
    p.finish()
    assert [r.getMessage() for r in caplog.records] == [
        "loading: reading shards (12.00 GB)",
        "loading: reading shards 5.00 GB of 12.00 GB (42%), 1.00 GB/s, ETA 7 s",
        "loading: reading shards 10.00 GB of 12.00 GB (83%), 1.00 GB/s, ETA 2 s",
        "loading: reading shards done: 12.00 GB in 12.0 s",
        "loading: warming up (3 passes)",
        "loading: warming up done: 3 passes in 0.0 s",
    ]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_a_bar_on_a_terminal_and_nothing_elsewhere(tty):
    stream = Terminal() if tty else io.StringIO()
    p = TerminalProgress(stream, out=stream)
    p.phase("writing shards", total=2e9)
    p.echo("  model-00001-of-00002.safetensors: 1.00 GB")
    p.advance(1e9)
    p.advance(1e9)
    p.finish()
    out = stream.getvalue()
    assert "  model-00001-of-00002.safetensors: 1.00 GB\n" in out
    assert ("writing shards: 100%" in out) == tty and ("|" in out) == tty
