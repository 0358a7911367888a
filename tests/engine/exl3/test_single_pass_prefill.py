"""The single-pass prefill patch point (glm53.engine.exl3.prefill.install_single_pass_prefill) against a stand-in exllamav3 job
module laid out like 1.6.5's: the real method is exercised on the GPU (tests/gpu/test_offload_exact.py)."""

from __future__ import annotations

import sys
import textwrap
import traceback

import pytest

from glm53.engine.exl3 import prefill

# The stand-in keeps the shape of exllamav3's Job.prefill around the split: a loop over sequences, the
# recurrent-model block that moves prefill_end back to the last page boundary, and one forward per call.
JOB_MODULE = '''
PAGE_SIZE = 256


class Seq:
    def __init__(self, n):
        self.sequence_ids = list(range(n))
        self.kv_position = 0


class Job:
    def __init__(self, generator, n):
        self.generator = generator
        self.sequences = [Seq(n)]
        self.forwards = []

    def prefill(self, results):
        """Stand-in for exllamav3's Job.prefill."""
        for seq in self.sequences:
            prefill_start = seq.kv_position
            prefill_end = len(seq.sequence_ids) - 1
            if prefill_end <= prefill_start:
                continue
            recurrent_last_page = False
            if self.generator.recurrent_cache is not None:
                seqlen = len(seq.sequence_ids) - 1
                last_page_b = seqlen // PAGE_SIZE * PAGE_SIZE
                if prefill_start < last_page_b <= prefill_end:
                    prefill_end = last_page_b
                    recurrent_last_page = True
            if self.generator.fail_at == prefill_start:
                raise RuntimeError("injected")
            self.forwards.append((prefill_start, prefill_end, recurrent_last_page))
            seq.kv_position = prefill_end
'''


class Generator:
    def __init__(self, recurrent=True, fail_at=None):
        self.recurrent_cache = object() if recurrent else None
        self.fail_at = fail_at


@pytest.fixture
def job_module(tmp_path, monkeypatch):
    def write(source: str):
        pkg = tmp_path / "exllamav3" / "generator"
        pkg.mkdir(parents=True)
        (tmp_path / "exllamav3" / "__init__.py").write_text("")
        (pkg / "__init__.py").write_text("")
        (pkg / "job.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))
        for name in [n for n in sys.modules if n == "exllamav3" or n.startswith("exllamav3.")]:
            monkeypatch.delitem(sys.modules, name)
        import exllamav3.generator.job as module

        return module

    yield write
    for name in [n for n in sys.modules if n == "exllamav3" or n.startswith("exllamav3.")]:
        del sys.modules[name]


def _prefill(module, generator, n):
    job = module.Job(generator, n)
    while job.sequences[0].kv_position < n - 1:
        job.prefill([])
    return job.forwards


def test_stock_splits_a_recurrent_prompt_at_its_last_page_and_a_flagged_generator_does_not(job_module):
    module = job_module(JOB_MODULE)
    assert _prefill(module, Generator(), 700) == [(0, 512, True), (512, 699, False)]  # the stand-in is faithful

    stock, single = Generator(), Generator()
    prefill.set_single_pass_prefill(stock, False)
    prefill.set_single_pass_prefill(single, True)
    assert getattr(module.Job.prefill, prefill.SINGLE_PASS_FLAG)
    assert module.Job.prefill.__doc__ == "Stand-in for exllamav3's Job.prefill."
    assert _prefill(module, single, 700) == [(0, 699, False)]
    assert _prefill(module, stock, 700) == [(0, 512, True), (512, 699, False)]  # unflagged: stock's schedule
    assert _prefill(module, Generator(recurrent=False), 700) == [(0, 699, False)]
    assert _prefill(module, single, 200) == [(0, 199, False)]

    patched = module.Job.prefill
    prefill.install_single_pass_prefill()  # idempotent
    assert module.Job.prefill is patched


def test_a_traceback_from_the_patched_method_points_at_the_line_in_exllamav3s_file(job_module):
    module = job_module(JOB_MODULE)
    generator = Generator(fail_at=0)
    prefill.set_single_pass_prefill(generator, True)
    with pytest.raises(RuntimeError, match="injected") as caught:
        module.Job(generator, 700).prefill([])
    frame = traceback.extract_tb(caught.value.__traceback__)[-1]
    assert frame.filename == module.__file__
    assert frame.line == 'raise RuntimeError("injected")'


def test_a_changed_prefill_fails_loudly_at_install(job_module):
    module = job_module(JOB_MODULE.replace("seqlen = len(seq.sequence_ids) - 1", "seqlen = len(seq.sequence_ids)"))
    original = module.Job.prefill
    with pytest.raises(prefill.InternalsChanged, match="last page"):
        prefill.set_single_pass_prefill(Generator(), True)
    assert module.Job.prefill is original
