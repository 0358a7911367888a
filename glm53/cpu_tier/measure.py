"""The CPU tier's cost model constants, measured on the running machine at start (``split``'s module docstring
says which figure comes from where): the CPU kernel on the checkpoint's own experts with the worker's pool, the
link's and VRAM's read rates on the GPU, and a round trip through the ring."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..cost_model import Costs
from . import kernel as ce
from .device import DeviceProducer, pack_picks
from .split import measure_cpu, pinned_cpu_cost
from .worker import Worker

TIMING_EXPERTS = 32  # experts the CPU figure is timed on at start


def measure_costs(experts: Mapping[tuple[int, int], tuple], *, ct_b: float | None, act_limit: float, codebook: str,
                  pool: ce.Pool, worker: Worker, producer: DeviceProducer, store, link, device: torch.device,
                  hidden: int) -> Costs:
    """The costs the split starts from.

    :param experts: the host store's experts as the CPU kernel reads them (``worker.host_store_experts``).
    :param ct_b: ``GLM53_CT_B``, a per-expert CPU time (ms) given outright (None: timed on ``TIMING_EXPERTS``).
    :param pool, worker, producer: the tier's started threads and its device side (the round trip runs through them).
    :param store: the pinned host store; ``link``: the offload's (an emulated one's rate, when it emulates).
    """
    sources = {}
    if ct_b is not None:
        cpu, job, sources["cpu_expert_s"] = pinned_cpu_cost(ct_b), {}, "GLM53_CT_B"
    else:
        keys = sorted(experts)[:TIMING_EXPERTS]
        cpu, job = measure_cpu([experts[k] for k in keys], act_limit=act_limit, pool=pool, batch=min(8, len(keys)),
                               codebook=codebook)
        sources["cpu_expert_s"] = f"timed on {len(keys)} experts at start, jobs of 1 and {min(8, len(keys))}"
    block = store.layout.block_bytes
    link_gbs = link_read_gbs(store, link)
    vram_gbs = vram_read_gbs(device)
    one = min(cpu)
    handoff = max(0.0, round_trip_s(worker, producer, hidden, device) - cpu[one] - job.get(one, 0.0))
    sources.update(link_expert_s=f"zero-copy read {link_gbs:.1f} GB/s", vram_expert_s=f"VRAM read {vram_gbs:.0f} GB/s",
                   handoff_s="one-expert round trip less its CPU time")
    return Costs(cpu, handoff_s=handoff, link_expert_s=block / (link_gbs * 1e9), vram_expert_s=block / (vram_gbs * 1e9),
                 sources=sources, cpu_job_s=job, cpu_pinned=ct_b is not None)


def round_trip_s(worker: Worker, producer: DeviceProducer, hidden: int, device: torch.device, jobs: int = 20) -> float:
    """The median GPU-side time of a one-expert job, published and collected, with the worker awake as in a decode
    step (asleep, each job would wait out its nap: on the H200 host a start-up measurement without the wake-up
    once gave 1.8 ms of handoff, which no live figure corrects, and kept the tier at rest)."""
    x = torch.zeros((1, hidden), dtype=torch.float16, device=device)
    picks = pack_picks(torch.tensor([0]), torch.tensor([0]), torch.tensor([0.5])).to(device)
    acc = torch.zeros((1, hidden), dtype=torch.float32, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(jobs)]
    worker.wake()
    try:
        producer.collect(producer.publish(0, x, picks), acc, 1.0)  # warm-up
        for start, end in events:
            start.record()
            producer.collect(producer.publish(0, x, picks), acc, 1.0)
            end.record()
        events[-1][1].synchronize()
    finally:
        worker.rest()
    return float(np.median([start.elapsed_time(end) for start, end in events])) / 1000.0


def link_read_gbs(store, link, max_bytes: int = 1 << 29) -> float:
    """SM reads of mapped host memory (the zero-copy miss path), 16 blocks, over one layer's arena, through the
    offload's link (an emulated one's rate, when it emulates)."""
    src = store.cuda_arena(0)[: min(max_bytes, store.cuda_arena(0).numel()) // 16 * 16]
    return link.read_rate_gbs(src, 16, reps=1)


def vram_read_gbs(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Device memory copy rate, counted as bytes read plus written (a resident expert is read once per use)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * nbytes / (start.elapsed_time(end) / 1000.0) / 1e9
