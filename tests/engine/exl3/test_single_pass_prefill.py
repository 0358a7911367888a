"""The single-pass prefill patch point (glm53.engine.exl3.prefill.install_single_pass_prefill): its wrappers against a
stand-in exllamav3 job module laid out like 1.6.5's, and what they rely on against 1.6.5's own ``Job`` source, read
from PyPI's wheel (``make exllamav3-source``). The real method runs on the GPU (tests/gpu/test_offload_exact.py)."""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import textwrap
import traceback
import zipfile
from pathlib import Path

import pytest

from glm53.engine.exl3 import prefill
from glm53.engine.exl3.patches import EXLLAMAV3_VERSION

REPO = Path(__file__).resolve().parents[3]
WHEEL = Path(sys.prefix) / "wheels" / f"exllamav3-{EXLLAMAV3_VERSION}-py3-none-any.whl"

# The stand-in keeps the shape of exllamav3's Job.prefill around the split: a loop over sequences, the partial-page
# copy that recurrent models skip, the recurrent-model block that moves prefill_end back to the last page boundary
# and stashes there, one forward per call, and the page hashing that moves a checkpoint to a page's final hash.
JOB_MODULE = '''
PAGE_SIZE = 256


class Seq:
    def __init__(self, n):
        self.sequence_ids = list(range(n))
        self.kv_position = 0


class Job:
    def __init__(self, generator, pagetable, n):
        self.generator = generator
        self.pagetable = pagetable
        self.sequences = [Seq(n)]
        self.forwards = []
        self.copied = []

    def prefill(self, results, chunk_size=None):
        """Stand-in for exllamav3's Job.prefill."""
        for seq in self.sequences:
            prefill_start = seq.kv_position
            prefill_end = len(seq.sequence_ids) - 1
            if prefill_end <= prefill_start:
                continue
            if prefill_start % PAGE_SIZE == 0 and self.generator.recurrent_cache is None:
                for page in self.pagetable.all_pages:
                    self.copied.append(page)
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
            self.hash_completed_page(seq, prefill_end // PAGE_SIZE)
            if recurrent_last_page:
                self.maybe_stash_recurrent(self.generator.recurrent_cache, PAGE_SIZE)

    def hash_completed_page(self, seq, page_idx):
        rc = self.generator.recurrent_cache
        if rc is not None:
            rc.rekeyed.append(page_idx)
        self.pagetable.referenced_pages[page_idx] = seq.kv_position

    def maybe_stash_recurrent(self, cache, interval=None):
        cache.stashed.append(self.sequences[0].kv_position)
'''


class RecurrentCache:
    def __init__(self):
        self.rekeyed, self.stashed = [], []


class Generator:
    def __init__(self, recurrent=True, fail_at=None):
        self.recurrent_cache = RecurrentCache() if recurrent else None
        self.fail_at = fail_at


class PageTable:
    def __init__(self):
        self.all_pages = ["a page whose start matches"]
        self.referenced_pages = {}


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


def _prefill(module, generator, n, pagetable=None):
    job = module.Job(generator, pagetable or PageTable(), n)
    while job.sequences[0].kv_position < n - 1:
        job.prefill([])
    return job


def test_stock_splits_a_recurrent_prompt_at_its_last_page_and_a_flagged_generator_does_not(job_module):
    module = job_module(JOB_MODULE)
    stock_job = _prefill(module, Generator(), 700)
    assert stock_job.forwards == [(0, 512, True), (512, 699, False)]  # the stand-in is faithful
    assert stock_job.generator.recurrent_cache.stashed == [512]

    stock, single = Generator(), Generator()
    prefill.set_single_pass_prefill(stock, False)
    prefill.set_single_pass_prefill(single, True)
    assert getattr(module.Job.prefill, prefill.SINGLE_PASS_FLAG)
    assert module.Job.prefill.__doc__ == "Stand-in for exllamav3's Job.prefill."
    assert _prefill(module, single, 700).forwards == [(0, 699, False)]
    assert single.recurrent_cache.stashed == []  # the split's stash went with it
    assert _prefill(module, stock, 700).forwards == [(0, 512, True), (512, 699, False)]  # unflagged: stock's schedule
    assert stock.recurrent_cache.stashed == [512]
    assert _prefill(module, Generator(recurrent=False), 700).forwards == [(0, 699, False)]
    assert _prefill(module, single, 200).forwards == [(0, 199, False)]

    patched = module.Job.prefill
    prefill.install_single_pass_prefill()  # idempotent
    assert module.Job.prefill is patched


def test_a_flagged_job_still_skips_the_partial_page_copy_and_its_pages_move_their_checkpoints(job_module):
    module = job_module(JOB_MODULE)
    generator, pagetable = Generator(), PageTable()
    prefill.set_single_pass_prefill(generator, True)
    job = _prefill(module, generator, 700, pagetable)
    assert job.copied == []  # a recurrent model's partial-page copy stays off, as stock has it
    assert generator.recurrent_cache.rekeyed == [2]  # hash_completed_page saw the real recurrent cache
    assert pagetable.referenced_pages == {2: 699}  # ... and the real page table
    assert job.generator is generator and job.pagetable is pagetable
    assert _prefill(module, Generator(recurrent=False), 700).copied == ["a page whose start matches"]  # the stand-in copies


def test_a_traceback_from_the_wrapped_method_points_at_the_line_in_exllamav3s_file(job_module):
    module = job_module(JOB_MODULE)
    generator, pagetable = Generator(fail_at=0), PageTable()
    prefill.set_single_pass_prefill(generator, True)
    job = module.Job(generator, pagetable, 700)
    with pytest.raises(RuntimeError, match="injected") as caught:
        job.prefill([])
    frame = traceback.extract_tb(caught.value.__traceback__)[-1]
    assert frame.filename == module.__file__
    assert frame.line == 'raise RuntimeError("injected")'
    assert job.generator is generator and job.pagetable is pagetable  # a failed prefill hands the job back whole


def test_a_changed_signature_fails_loudly_at_install(job_module):
    module = job_module(JOB_MODULE.replace("def hash_completed_page(self, seq, page_idx):", "def hash_completed_page(self, seq, idx):"))
    original = module.Job.prefill
    with pytest.raises(prefill.InternalsChanged, match="hash_completed_page"):
        prefill.set_single_pass_prefill(Generator(), True)
    assert module.Job.prefill is original


# ----- against exllamav3's own source


@pytest.fixture(scope="module")
def job_class() -> dict[str, ast.FunctionDef]:
    """The methods of exllamav3 1.6.5's ``Job``, parsed from the wheel PyPI serves (pinned in nix/pins/pypi.json)."""
    assert WHEEL.is_file(), f"{WHEEL} is missing: `make exllamav3-source` downloads it (make test does)"
    pin = json.loads((REPO / "nix" / "pins" / "pypi.json").read_text())["packages"]["exllamav3"]
    assert pin["version"] == EXLLAMAV3_VERSION and hashlib.sha256(WHEEL.read_bytes()).hexdigest() == pin["sha256"]
    source = zipfile.ZipFile(WHEEL).read("exllamav3/generator/job.py").decode()
    (job,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Job"]
    return {f.name: f for f in job.body if isinstance(f, ast.FunctionDef)}


def _reads(function: ast.FunctionDef, *chain: str) -> list[ast.Attribute]:
    """Every ``self.<chain>`` in ``function`` (``_reads(f, "generator", "recurrent_cache")``: self.generator.recurrent_cache)."""
    text = ".".join(("self", *chain))
    return [n for n in ast.walk(function) if isinstance(n, ast.Attribute) and ast.unparse(n) == text]


def _contains(tree: ast.AST | list[ast.stmt], node: ast.AST) -> bool:
    return any(m is node for t in (tree if isinstance(tree, list) else [tree]) for m in ast.walk(t))


def _ifs(function: ast.FunctionDef, node: ast.AST, where: str) -> list[ast.If]:
    """The ``if`` statements of ``function`` with ``node`` in their ``test`` or their ``body``, outermost first."""
    found = (n for n in ast.walk(function) if isinstance(n, ast.If) and _contains(getattr(n, where), node))
    return sorted(found, key=lambda n: n.lineno)


def test_the_wrapped_methods_take_what_the_wrappers_pass(job_class):
    for name, expected in (("prefill", prefill.PREFILL_PARAMS), ("hash_completed_page", prefill.HASH_PARAMS)):
        assert tuple(a.arg for a in job_class[name].args.args) == expected, name
    assert ast.unparse(job_class["prefill"].args.defaults[0]) == "None"


def test_prefill_reads_the_recurrent_cache_only_at_the_partial_page_copy_the_split_and_its_stash(job_class):
    body = job_class["prefill"]
    reads = _reads(body, "generator", "recurrent_cache")
    assert len(reads) == 3
    guards = sorted((i for r in reads for i in _ifs(body, r, "test")), key=lambda i: i.lineno)
    assert [ast.unparse(i.test) for i in guards] == ["prefill_start == p0 * PAGE_SIZE and self.generator.recurrent_cache is None",
                                                    "self.generator.recurrent_cache is not None"]
    sets_last_page = [n for n in ast.walk(body) if isinstance(n, ast.Assign) and ast.unparse(n) == "recurrent_last_page = True"]
    assert len(sets_last_page) == 1 and _contains(guards[1].body, sets_last_page[0])  # only the split sets it
    (stash,) = [r for r in reads if not any(_contains(i.test, r) for i in guards)]
    assert ast.unparse(_ifs(body, stash, "body")[-1].test) == "recurrent_last_page"
    calls = [n for n in ast.walk(body) if isinstance(n, ast.Call) and any(a is stash for a in n.args)]
    assert [ast.unparse(c.func) for c in calls] == ["self.maybe_stash_recurrent"]


def test_prefill_reads_the_page_table_only_for_the_partial_page_copy(job_class):
    body = job_class["prefill"]
    (read,) = _reads(body, "pagetable")
    (copy_guard,) = [i for i in ast.walk(body) if isinstance(i, ast.If) and ast.unparse(i.test).endswith("recurrent_cache is None")]
    loops = [n for n in ast.walk(copy_guard) if isinstance(n, ast.For) and ast.unparse(n.iter) == "self.pagetable.all_pages"]
    assert len(loops) == 1 and _contains(loops[0].iter, read)
    # what follows the loop in that block acts only on a page the loop found (with no page, nothing happens)
    after = copy_guard.body[copy_guard.body.index(loops[0]) + 1:]
    assert [ast.unparse(s.test) for s in after if isinstance(s, ast.If)][-1] == "best_match_page and best_match > 1"


def test_prefill_changes_neither_view_and_hands_them_to_no_one(job_class):
    body = job_class["prefill"]
    stored = [ast.unparse(t) for n in ast.walk(body) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    assert not [s for s in stored if s.startswith(("self.generator", "self.pagetable"))]
    whole = [n for n in ast.walk(body) if isinstance(n, ast.Call)
             for a in [*n.args, *(k.value for k in n.keywords)] if ast.unparse(a) in ("self.generator", "self.pagetable")]
    assert whole == []


def _self_calls(function: ast.FunctionDef) -> set[str]:
    return {n.func.attr for n in ast.walk(function) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and ast.unparse(n.func.value) == "self"}


def test_of_the_methods_a_single_pass_reaches_only_hash_completed_page_reads_the_recurrent_cache_or_page_table(job_class):
    # maybe_stash_recurrent is called only after the split (the test above); the other two run in a single pass too
    assert _self_calls(job_class["prefill"]) == {"mm_exact_spans", "hash_completed_page", "maybe_stash_recurrent"}
    spans = job_class["mm_exact_spans"]
    assert not _reads(spans, "generator", "recurrent_cache") and not _reads(spans, "pagetable") and not _self_calls(spans)
    hashing = job_class["hash_completed_page"]
    assert _reads(hashing, "generator", "recurrent_cache") and _reads(hashing, "pagetable") and not _self_calls(hashing)
