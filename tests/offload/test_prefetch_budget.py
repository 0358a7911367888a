"""Prefetch's copy budget (glm53.offload.prefetch.CopyBudget) over its window clock's samples: the pool's slots until
a layer's window is measured, then the copies that start inside the median window. The clock's device timing is
in tests/gpu/test_prefetch.py."""

from __future__ import annotations

from glm53.offload.prefetch import CopyBudget, WindowClock

MB = 1_000_000


def test_a_layer_without_a_measured_window_may_fill_the_pool():
    budget = CopyBudget(copy_gbs=10.0, block_bytes=MB, layers=3)
    assert [budget.copies(row, 2) for row in range(3)] == [2, 2, 2]
    assert budget.stats() == {"copy_gbs": 10.0, "window_us": [None, None, None]}


def test_the_budget_is_the_copies_that_start_in_the_median_window_at_most_the_slots():
    clock = WindowClock(3, keep=3)
    clock.samples[1].extend([90e-6, 250e-6, 120e-6])  # median 120 us; a copy takes 100 us at 10 GB/s
    clock.samples[2].extend([2e-3])
    budget = CopyBudget(copy_gbs=10.0, block_bytes=MB, layers=3, clock=clock)
    assert budget.copies(1, 8) == 2 and budget.copies(2, 8) == 8 and budget.copies(2, 30) == 20
    clock.samples[1].extend([50e-6, 60e-6])  # the oldest fall out: 120, 50, 60 -> 60 us, one copy
    assert budget.copies(1, 8) == 1
    assert budget.stats()["window_us"] == [None, 60.0, 2000.0]


def test_only_every_nth_forward_is_sampled():
    clock = WindowClock(2, every=4)
    sampled = []
    for _ in range(9):
        clock.forward_start()
        sampled.append(clock.sampling)
    assert sampled == [True, False, False, False, True, False, False, False, True]
