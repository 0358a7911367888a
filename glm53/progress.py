"""How far long work has got: a sequence of phases (reading shards, pinning, loading the model, warming up, ...),
each with an amount done of a total, in bytes or in counted steps.

The code doing the work reports through a :class:`Progress` it is handed (``phase``, ``update``, or ``steps`` for
libraries that take a ``(done, total)`` callback, as exllamav3's load and warm-up do); what happens with the
reports is the subclass's business:

- :class:`Progress` itself only keeps the state, for :meth:`Progress.snapshot` (``/health`` while loading);
- :class:`LoggedProgress` also logs a line when a phase starts, every few seconds while it runs, and when it ends;
- :class:`TerminalProgress` draws a bar (tqdm) when its stream is a terminal, and draws nothing otherwise.

The working thread writes and other threads read: each report replaces one immutable :class:`PhaseState`, so a
reader always sees a consistent state without a lock. This module imports nothing of the project.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TextIO

BYTES = "B"


@dataclass(frozen=True)
class PhaseState:
    name: str
    unit: str  # BYTES, or what is counted ("modules", "passes")
    total: float | None  # None: not known
    done: float
    started: float  # clock time


class Progress:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._state: PhaseState | None = None

    def phase(self, name: str, total: float | None = None, unit: str = BYTES) -> None:
        """Start a phase (the one before it ends)."""
        self.finish()
        self._state = PhaseState(name, unit, total, 0, self._clock())
        self._started(self._state)

    def update(self, done: float, total: float | None = None) -> None:
        """The amount done so far in the current phase (and its total, when it became known or changed)."""
        state = self._state
        self._state = replace(state, done=done, total=state.total if total is None else total)
        self._changed(self._state)

    def advance(self, amount: float) -> None:
        self.update(self._state.done + amount)

    def steps(self, name: str, unit: str = BYTES) -> Callable[[int, int], None]:
        """A ``(done, total)`` callback that reports phase ``name``, started at its first call."""

        def report(done: int, total: int) -> None:
            if self._state is None or self._state.name != name:
                self.phase(name, total, unit)
            self.update(done, total)

        return report

    def finish(self) -> None:
        """End the current phase, if any."""
        if self._state is not None:
            state, self._state = self._state, None
            self._finished(state)

    def snapshot(self) -> dict:
        """``phase`` (None when none runs), ``progress`` (the fraction done, None when the total is not known),
        ``done``, ``total``, ``unit``, ``rate_per_s`` (since the phase started) and ``eta_s``."""
        state = self._state
        if state is None:
            return {"phase": None, "progress": None}
        rate = _rate(state, self._clock())
        return {
            "phase": state.name,
            "progress": round(state.done / state.total, 4) if state.total else None,
            "done": state.done,
            "total": state.total,
            "unit": state.unit,
            "rate_per_s": round(rate, 2) if rate is not None else None,
            "eta_s": round((state.total - state.done) / rate, 1) if rate and state.total else None,
        }

    # what a subclass does with the reports
    def _started(self, state: PhaseState) -> None:
        pass

    def _changed(self, state: PhaseState) -> None:
        pass

    def _finished(self, state: PhaseState) -> None:
        pass


def _rate(state: PhaseState, now: float) -> float | None:
    elapsed = now - state.started
    return state.done / elapsed if elapsed > 0 and state.done else None


def amount(value: float, unit: str) -> str:
    """``12.30 GB`` for bytes, ``12 modules`` for counted steps."""
    return f"{value / 1e9:.2f} GB" if unit == BYTES else f"{value:g} {unit}"


class LoggedProgress(Progress):
    """Logs each phase: when it starts, at most every ``interval_s`` while it runs (done of total, rate, ETA),
    and when it ends."""

    def __init__(self, log: logging.Logger, interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        super().__init__(clock)
        self._log = log
        self._interval_s = interval_s
        self._last_line = 0.0

    def _started(self, state: PhaseState) -> None:
        self._last_line = state.started
        total = f" ({amount(state.total, state.unit)})" if state.total else ""
        self._log.info("loading: %s%s", state.name, total)

    def _changed(self, state: PhaseState) -> None:
        now = self._clock()
        if now - self._last_line < self._interval_s or (state.total and state.done >= state.total):
            return
        self._last_line = now
        snap = self.snapshot()
        parts = [f"{amount(state.done, state.unit)} of {amount(state.total, state.unit)} ({100 * snap['progress']:.0f}%)"
                 if state.total else amount(state.done, state.unit)]
        if snap["rate_per_s"] is not None:
            parts.append(f"{amount(snap['rate_per_s'], state.unit)}/s")
        if snap["eta_s"] is not None:
            parts.append(f"ETA {snap['eta_s']:.0f} s")
        self._log.info("loading: %s %s", state.name, ", ".join(parts))

    def _finished(self, state: PhaseState) -> None:
        seconds = self._clock() - state.started
        done = f"{amount(state.done, state.unit)} " if state.done else ""
        self._log.info("loading: %s done: %sin %.1f s", state.name, done, seconds)


class TerminalProgress(Progress):
    """A tqdm bar per phase on ``stream`` (default stderr) when it is a terminal; nothing when it is not (a log
    file, a pipe). Lines of output go through :meth:`echo` to ``out`` (default stdout)."""

    def __init__(self, stream: TextIO | None = None, out: TextIO | None = None):
        super().__init__()
        self._stream = stream or sys.stderr
        self._out = out or sys.stdout
        self._bar = None

    def echo(self, line: str) -> None:
        """Print a line of output without breaking the bar (tqdm clears it, writes, and redraws it)."""
        from tqdm import tqdm

        tqdm.write(line, file=self._out)
        self._out.flush()

    def _started(self, state: PhaseState) -> None:
        from tqdm import tqdm

        # disable=None: tqdm draws only when the stream is a terminal
        self._bar = tqdm(desc=state.name, total=state.total, unit=state.unit, unit_scale=state.unit == BYTES,
                         file=self._stream, disable=None, leave=True)

    def _changed(self, state: PhaseState) -> None:
        if state.total is not None and self._bar.total != state.total:
            self._bar.total = state.total
        self._bar.update(state.done - self._bar.n)

    def _finished(self, state: PhaseState) -> None:
        self._bar.close()
        self._bar = None
