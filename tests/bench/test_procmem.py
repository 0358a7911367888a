"""bench/procmem.py: a process tree's memory from /proc (the real one, and a fake with awkward command names)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench import procmem


def test_tree_and_memory_of_this_process_with_a_child():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in procmem.tree(os.getpid())
        mem = procmem.tree_memory(os.getpid())
        assert mem["processes"] >= 2 and mem["rss"] > 10_000_000 and mem["hwm"] >= mem["rss"] * 0.5
        assert 0 < mem["pss"] <= mem["rss"]
    finally:
        child.kill()
        child.wait()


def _fake_proc(root: Path, procs: dict[int, tuple[int, str, int]]) -> Path:
    """pid -> (ppid, command name, VmRSS kB)."""
    for pid, (ppid, comm, rss) in procs.items():
        d = root / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1\n")
        (d / "status").write_text(f"Name:\t{comm}\nVmHWM:\t{2 * rss} kB\nVmRSS:\t{rss} kB\nVmLck:\t0 kB\nVmPin:\t4 kB\n")
        (d / "smaps_rollup").write_text(f"Rss: {rss} kB\nPss: {rss // 2} kB\n")
    (root / "self").mkdir()
    return root


def test_fake_proc_tree(tmp_path):
    proc = _fake_proc(tmp_path, {10: (1, "python3", 100), 11: (10, "evil) 1 (name", 50), 12: (11, "w", 25), 13: (1, "other", 999)})
    assert sorted(procmem.tree(10, proc)) == [10, 11, 12]
    mem = procmem.tree_memory(10, proc)
    assert mem == {"rss": 175 * 1024, "hwm": 350 * 1024, "locked": 12 * 1024, "pss": 87 * 1024, "processes": 3}


def test_peak_sampler(tmp_path):
    proc = _fake_proc(tmp_path, {10: (1, "python3", 100)})
    with procmem.PeakSampler(10, interval=0.01, proc=proc) as s:
        (proc / "10" / "status").write_text("VmRSS:\t300 kB\n")
        s.sample()
        (proc / "10" / "status").write_text("VmRSS:\t200 kB\n")
    assert s.peak == 300 * 1024
