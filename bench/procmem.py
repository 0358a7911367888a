"""Host memory of a process and its descendants, from /proc (Linux), for the compare arms.

Stock exllamav3's CPU offload keeps the experts in a worker process, so an arm's host memory is its whole process
tree. RSS sums count shared pages (the ``-mcpa`` arena is mapped in both processes) once per process; PSS
(``smaps_rollup``) splits them, so the PSS sum is the tree's real footprint.
"""

from __future__ import annotations

import threading
from pathlib import Path

PROC = Path("/proc")
KB = 1024


def _children(proc: Path) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the command name (field 2) may hold spaces and parentheses: fields after the last ')' are fixed
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def tree(pid: int, proc: Path = PROC) -> list[int]:
    """``pid`` and all its descendants alive now."""
    kids = _children(proc)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _status_kb(pid: int, fields: tuple[str, ...], proc: Path) -> dict[str, int]:
    out = dict.fromkeys(fields, 0)
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in out:
                out[key] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


def _pss_kb(pid: int, proc: Path) -> int:
    try:
        for line in (proc / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_memory(pid: int, proc: Path = PROC, pss: bool = True) -> dict:
    """Bytes over the tree: ``rss`` (VmRSS sum), ``hwm`` (VmHWM sum: each process's own peak, an upper bound of
    the tree's peak), ``locked`` (VmLck + VmPin), ``pss`` (None when not asked), ``processes``."""
    pids = tree(pid, proc)
    totals = {"VmRSS": 0, "VmHWM": 0, "VmLck": 0, "VmPin": 0}
    for p in pids:
        for key, kb in _status_kb(p, tuple(totals), proc).items():
            totals[key] += kb
    return {
        "rss": totals["VmRSS"] * KB,
        "hwm": totals["VmHWM"] * KB,
        "locked": (totals["VmLck"] + totals["VmPin"]) * KB,
        "pss": sum(_pss_kb(p, proc) for p in pids) * KB if pss else None,
        "processes": len(pids),
    }


class PeakSampler:
    """Samples the tree's RSS sum on a thread; ``peak`` is the largest sum seen."""

    def __init__(self, pid: int, interval: float = 0.25, proc: Path = PROC):
        self.pid, self.interval, self.proc = pid, interval, proc
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.native_id: int | None = None  # the sampling thread's id (a measurement may leave its CPU time out)

    def _run(self) -> None:
        self.native_id = threading.get_native_id()
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> int:
        rss = tree_memory(self.pid, self.proc, pss=False)["rss"]
        self.peak = max(self.peak, rss)
        return rss

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()
