"""glm53/engine/exl3/core_order.py: the Python stand-in for exllamav3's exl3_moe_cpu_core_order, read from a fake
sysfs tree, and its installation in an arm's interpreters (including a multiprocessing spawn child) through the
shim's sitecustomize, against a stand-in exllamav3 package whose C++ function must never be called."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from glm53.engine.exl3 import core_order

REPO = Path(__file__).resolve().parents[3]


def fake_sysfs(root: Path, topology: dict[int, tuple[int, int] | None]) -> Path:
    """cpuN/topology/{physical_package_id,core_id} for each cpu: (package, core), or None for no topology."""
    for cpu, ids in topology.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        if ids is not None:
            (d / "physical_package_id").write_text(f"{ids[0]}\n")
            (d / "core_id").write_text(f"{ids[1]}\n")
    return root


@pytest.mark.parametrize(
    "topology, order, physical",
    [
        # 2 packages x 2 cores x 2 threads, Linux's usual numbering: siblings are the upper half
        ({0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 4: (0, 0), 5: (0, 1), 6: (1, 0), 7: (1, 1)}, [0, 1, 2, 3, 4, 5, 6, 7], 4),
        # siblings interleaved (cpu 2k+1 is cpu 2k's sibling)
        ({0: (0, 0), 1: (0, 0), 2: (0, 1), 3: (0, 1), 4: (0, 2), 5: (0, 2)}, [0, 2, 4, 1, 3, 5], 3),
        # the same core_id on two packages: two cores
        ({0: (0, 0), 1: (1, 0)}, [0, 1], 2),
        # no SMT
        ({0: (0, 0), 1: (0, 1), 2: (0, 2)}, [0, 1, 2], 3),
        # unreadable topology: the CPU counts as a core of its own, wherever it is
        ({0: (0, 0), 1: None, 2: (0, 0)}, [0, 1, 2], 2),
    ],
)
def test_core_order_from_sysfs(tmp_path, topology, order, physical):
    root = fake_sysfs(tmp_path, topology)
    assert core_order.core_order(root, ncpu=len(topology)) == (order, physical)


def test_core_ids_need_not_be_contiguous(tmp_path):
    root = fake_sysfs(tmp_path, {0: (0, 0), 1: (0, 4), 2: (0, 8), 3: (0, 0), 4: (0, 4), 5: (0, 8)})
    assert core_order.core_order(root, ncpu=6) == ([0, 1, 2, 3, 4, 5], 3)


def test_this_machine_has_every_cpu_once():
    order, physical = core_order.core_order()
    assert sorted(order) == list(range(os.cpu_count()))
    assert 1 <= physical <= len(order)


def _crash():
    raise AssertionError("the C++ exl3_moe_cpu_core_order was called")


FAKE_EXT = "import types\n\ndef _crash():\n    raise SystemError('C++ core order called')\n\nexllamav3_ext = types.SimpleNamespace(exl3_moe_cpu_core_order=_crash)\n"
# exllamav3.model.moe_cpu_host calls the function at import time, as 1.6.5 does (TUNING = MoeCpuTuning())
FAKE_HOST = "from ..ext import exllamav3_ext as ext\nORDER = ext.exl3_moe_cpu_core_order()\n\ndef report(queue):\n    queue.put(ORDER)\n"


@pytest.fixture
def fake_exllamav3(tmp_path) -> Path:
    pkg = tmp_path / "site" / "exllamav3"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import ext\n")
    (pkg / "ext.py").write_text(FAKE_EXT)
    (pkg / "model" / "__init__.py").write_text("")
    (pkg / "model" / "moe_cpu_host.py").write_text(FAKE_HOST)
    return tmp_path / "site"


def test_import_hook_patches_the_extension_as_it_loads(fake_exllamav3, monkeypatch):
    monkeypatch.syspath_prepend(str(fake_exllamav3))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for name in [m for m in sys.modules if m == "exllamav3" or m.startswith("exllamav3.")]:
        monkeypatch.delitem(sys.modules, name)
    core_order.install_import_hook()
    try:
        from exllamav3.model import moe_cpu_host  # the import-time call must already see the replacement

        assert moe_cpu_host.ORDER == core_order.core_order()
        core_order.install_import_hook()  # a second install (module already loaded) patches in place
        assert sys.modules["exllamav3.ext"].exllamav3_ext.exl3_moe_cpu_core_order is core_order.core_order
    finally:
        for name in [m for m in sys.modules if m == "exllamav3" or m.startswith("exllamav3.")]:
            del sys.modules[name]


def test_patch_extension_replaces_the_function():
    ext = types.SimpleNamespace(exl3_moe_cpu_core_order=_crash)
    core_order.patch_extension(ext)
    assert ext.exl3_moe_cpu_core_order() == core_order.core_order()


DRIVER = textwrap.dedent("""
    import multiprocessing as mp

    if __name__ == "__main__":
        from exllamav3.model import moe_cpu_host
        ctx = mp.get_context("spawn")  # how exllamav3 starts its CPU worker
        queue = ctx.Queue()
        child = ctx.Process(target=moe_cpu_host.report, args=(queue,))
        child.start()
        print(repr(moe_cpu_host.ORDER), repr(queue.get(timeout=60)))
        child.join()
""")


def test_shim_applies_in_the_arm_and_in_its_spawned_worker(fake_exllamav3, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "bench" / "mcs_shim"), str(REPO), str(fake_exllamav3)]))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    expected = repr(core_order.core_order())
    assert out.stdout.strip() == f"{expected} {expected}"

    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(fake_exllamav3)])  # without the shim: the stand-in C++ call
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode != 0 and "C++ core order called" in out.stderr
