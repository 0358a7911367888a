import threading
import time

import pytest

from glm53.engine.interface import Delta, Finish, GenerationRequest, LogprobRequest, Scored, ScoreRequest
from glm53.engine.scheduler import NotReady, QueueFull, Scheduler
from tests.fakes import EOS, FAIL_ALONE, PREFILL, ScriptedBackend


class Collector:
    def __init__(self):
        self.events = []
        self.done = threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if isinstance(ev, (Finish, Scored)):
            self.done.set()

    def wait(self):
        assert self.done.wait(10), "job did not finish"
        return self

    @property
    def text(self):
        return "".join(e.text for e in self.events if isinstance(e, Delta))

    @property
    def finish(self):
        return self.events[-1]


def started(backend, max_queue=16):
    s = Scheduler(lambda: backend, max_queue)
    s.start()
    for _ in range(200):
        if s.state == "ready":
            return s
        time.sleep(0.01)
    raise AssertionError(s.state)


def gen(prompt=b"p", **kw):
    kw.setdefault("max_new_tokens", 100)
    return GenerationRequest(prompt_ids=tuple(prompt), **kw)


def test_eos_ends_the_job_and_its_text_is_not_emitted():
    s = started(ScriptedBackend())
    c = Collector()
    s.submit(gen(), c)
    c.wait()
    assert c.text == "hello world"
    assert c.finish == Finish("stop", 1, 12, matched=EOS)
    s.stop()


def test_ignore_eos_runs_to_the_length_limit():
    s = started(ScriptedBackend())
    c = Collector()
    s.submit(gen(max_new_tokens=15, ignore_eos=True, skip_special=True), c)
    c.wait()
    assert c.finish.reason == "length" and c.finish.completion_tokens == 15
    assert c.text == "hello world"  # the EOS tokens' text is a control marker, skipped
    s.stop()


def test_stop_string_cuts_the_text_before_it():
    s = started(ScriptedBackend())
    c = Collector()
    s.submit(gen(stop_strings=("o w",)), c)
    c.wait()
    assert c.text == "hell"
    assert c.finish.reason == "stop" and c.finish.matched == "o w"
    s.stop()


def test_partial_stop_match_is_released_at_the_end():
    s = started(ScriptedBackend(script=lambda p: list(b"abc")))
    c = Collector()
    s.submit(gen(stop_strings=("cx",)), c)
    c.wait()
    assert c.text == "abc" and c.finish.reason == "stop" and c.finish.matched == EOS
    s.stop()


def test_length_limit_counts_generated_tokens():
    s = started(ScriptedBackend())
    c = Collector()
    s.submit(gen(max_new_tokens=3), c)
    c.wait()
    assert c.text == "hel" and c.finish == Finish("length", 1, 3)
    s.stop()


def test_context_length_caps_the_completion():
    s = started(ScriptedBackend(context_length=5))
    c = Collector()
    s.submit(gen(prompt=b"abc", max_new_tokens=100), c)
    c.wait()
    assert c.finish.reason == "length" and c.finish.completion_tokens == 2
    s.stop()


def test_multibyte_text_is_never_split():
    s = started(ScriptedBackend(script=lambda p: list("héllo €".encode())))
    c = Collector()
    s.submit(gen(), c)
    c.wait()
    assert all("\ufffd" not in e.text for e in c.events if isinstance(e, Delta))
    assert c.text == "héllo €"
    s.stop()


def test_batch_size_is_respected_and_admission_is_first_come_first_served():
    backend = ScriptedBackend(max_batch_size=2)
    s = started(backend)
    cs = [Collector() for _ in range(6)]
    jobs = [s.submit(gen(), c) for c in cs]
    for c in cs:
        c.wait()
    assert backend.max_active == 2
    assert backend.added == [j.id for j in jobs]
    assert sorted(backend.removed) == sorted(j.id for j in jobs)
    s.stop()


def test_queue_limit_refuses_beyond_batch_plus_queue():
    s = started(ScriptedBackend(max_batch_size=2, script=lambda p: [65] * 10_000), max_queue=1)
    cs = [Collector() for _ in range(3)]
    jobs = [s.submit(gen(max_new_tokens=10_000), c) for c in cs]
    with pytest.raises(QueueFull):
        s.submit(gen(), Collector())
    for j in jobs:
        s.cancel(j)
    for c in cs:
        assert c.wait().finish.reason == "cancelled"
    assert s.snapshot()["in_system"] == 0
    again = Collector()
    s.submit(gen(max_new_tokens=3), again)  # room again
    assert again.wait().finish.reason == "length"
    s.stop()


def test_cancel_frees_the_sequence_promptly():
    backend = ScriptedBackend(script=lambda p: [65] * 100_000)
    s = started(backend)
    c = Collector()
    job = s.submit(gen(max_new_tokens=100_000), c)
    while not any(isinstance(e, Delta) for e in c.events):
        time.sleep(0.001)
    s.cancel(job)
    c.wait()
    assert c.finish.reason == "cancelled"
    assert backend.removed == [job.id] and backend.seqs == {}
    s.stop()


def test_a_refused_job_fails_alone():
    s = started(ScriptedBackend())
    bad, good = Collector(), Collector()
    s.submit(gen(prompt=b"\x00x"), bad)
    s.submit(gen(), good)
    assert bad.wait().finish.reason == "error" and "test hook" in bad.finish.error
    assert good.wait().finish.reason == "stop" and good.text == "hello world"
    s.stop()


def test_a_failed_step_ends_the_batch_and_the_server_keeps_serving():
    backend = ScriptedBackend(fail_on_step=3)
    s = started(backend)
    a = Collector()
    s.submit(gen(), a)
    assert a.wait().finish.reason == "error" and "injected" in a.finish.error
    b = Collector()
    s.submit(gen(), b)
    assert b.wait().text == "hello world"
    assert s.snapshot()["engine_errors"] == 1
    s.stop()


def test_scoring_runs_in_chunks_and_returns_entries():
    s = started(ScriptedBackend())
    c = Collector()
    s.submit(ScoreRequest((1, 2, 3, 4), 0, LogprobRequest()), c)
    c.wait()
    assert isinstance(c.finish, Scored)
    assert c.finish.entries[0] is None and [e.logprob for e in c.finish.entries[1:]] == [-1.0, -2.0, -3.0]
    s.stop()


def test_logprobs_are_delivered_with_the_tokens():
    s = started(ScriptedBackend(script=lambda p: [65, 66]))
    c = Collector()
    s.submit(gen(logprobs=LogprobRequest(top_n=1)), c)
    c.wait()
    lps = [lp for e in c.events if isinstance(e, Delta) for lp in e.logprobs]
    assert [lp.top[0][0] for lp in lps] == [65, 66, EOS]
    s.stop()


def test_submit_before_ready_and_after_a_failed_load():
    gate = threading.Event()

    def slow():
        gate.wait(5)
        raise RuntimeError("no weights")

    failures = []
    s = Scheduler(slow, 4)
    s.start(on_failure=failures.append)
    with pytest.raises(NotReady):
        s.submit(gen(), Collector())
    gate.set()
    for _ in range(200):
        if s.state == "failed":
            break
        time.sleep(0.01)
    assert s.state == "failed" and failures == ["RuntimeError: no weights"]
    with pytest.raises(NotReady, match="no weights"):
        s.submit(gen(), Collector())


def test_a_sequence_the_engine_fails_alone_ends_alone_and_the_batch_goes_on():
    backend = ScriptedBackend(script=lambda p: [65, 66, FAIL_ALONE] if p[0] == ord("f") else list(b"hello world"))
    s = started(backend)
    bad, good = Collector(), Collector()
    bad_job = s.submit(gen(prompt=b"f"), bad)
    good_job = s.submit(gen(), good)
    assert bad.wait().finish == Finish("error", 1, 2, error=f"injected failure of sequence {bad_job.id}")
    assert bad.text == "AB"
    assert good.wait().finish.reason == "stop" and good.text == "hello world"
    snap = s.snapshot()
    assert (snap["sequence_errors"], snap["engine_errors"], snap["jobs_error"], snap["in_system"]) == (1, 0, 1, 0)
    assert sorted(backend.removed) == sorted([bad_job.id, good_job.id]) and backend.seqs == {}
    s.stop()


def test_prefix_cache_hits_reach_the_first_delta_the_finish_and_the_counters():
    s = started(ScriptedBackend(script=lambda p: [65, 66], cached=lambda p: 3 if p[0] == ord("c") else 0))
    assert s.snapshot()["prefix_cache_hit_rate"] is None  # no prefill completed yet
    hit, miss = Collector(), Collector()
    s.submit(gen(prompt=b"cached"), hit)
    s.submit(gen(prompt=b"fresh!!"), miss)
    hit.wait()
    miss.wait()
    deltas = [e for e in hit.events if isinstance(e, Delta)]
    assert [d.cached_tokens for d in deltas] == [3, None, None]
    assert hit.finish == Finish("stop", 6, 3, matched=EOS, cached_tokens=3)
    assert miss.finish.cached_tokens == 0 and next(e for e in miss.events if isinstance(e, Delta)).cached_tokens == 0
    snap = s.snapshot()
    assert (snap["prefix_cache_hits"], snap["prefix_cache_misses"], snap["prefix_cache_hit_rate"]) == (3, 3 + 7, 0.2308)
    s.stop()


def test_a_job_cancelled_before_its_first_token_counts_no_prefill():
    backend = ScriptedBackend(script=lambda p: [PREFILL] * 100_000, cached=lambda p: 2, step_seconds=0.001)
    s = started(backend)
    c = Collector()
    job = s.submit(gen(prompt=b"long prefill"), c)
    while not backend.seqs:
        time.sleep(0.001)
    s.cancel(job)
    assert c.wait().finish == Finish("cancelled", 12, 0)
    snap = s.snapshot()
    assert (snap["prefix_cache_hits"], snap["prefix_cache_misses"], snap["prompt_tokens"]) == (0, 0, 12)
    s.stop()
