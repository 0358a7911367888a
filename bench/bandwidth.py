"""Memory bandwidths that bound expert offload, measured on the running machine (``bench/compare.py`` runs this
in a fresh process of its own):

- ``pcie_h2d_gbs``: a pinned host buffer copied to the GPU (``cudaMemcpyAsync``, the copy engine);
- ``pcie_zero_copy_read_gbs``: a GPU kernel (a sum) reading pinned host memory in place through a device alias
  (exllamav3's ``pinned_cuda_view``, else the UVA pointer): how the exact mode reads a cache miss;
- ``dram_read_gbs``: host threads summing disjoint slices of one large buffer (NumPy releases the GIL);
- ``hbm_copy_gbs``: a device-to-device copy, read plus written bytes.

Each figure is the best of a few repetitions (bandwidth is a capacity; the best run is the least disturbed).

With ``--link-emulate-gbs``, the offload's in-band emulation of a slower link (``glm53.offload.link``) is checked on the
same kind of memory: for each target, a full grid's zero-copy read, a 64-block one (about what a decode step's
experts read with) and a copy-engine copy, each through the emulated link, against the target (``link_emulation``:
each rate and its ratio to the target; the emulation is valid where all are within 5 %).

    python3 -m bench.bandwidth [--gib 1] [--link-emulate-gbs 12.5 25 50] [--out bw.json]
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from bench.output import emit_json

GIB = 1 << 30


def _timed_cuda(fn, reps: int) -> float:
    """Best seconds of ``fn`` over ``reps`` runs after one warm-up, timed with CUDA events."""
    from glm53.offload.link import cuda_seconds

    return cuda_seconds(fn, reps, min)


def _device_alias(host):
    """A CUDA tensor aliasing pinned ``host`` memory (no copy)."""
    import torch

    try:
        from glm53.engine.exl3.patches import pinned_cuda_view

        return pinned_cuda_view(host, torch.cuda.current_device()), "exllamav3 pinned_cuda_view"
    except (ImportError, AttributeError):
        pass

    interface = {"shape": tuple(host.shape), "typestr": "<i4", "data": (host.data_ptr(), False), "version": 2}
    # UVA: pinned host memory has the same address on the device
    alias = torch.as_tensor(type("PinnedHost", (), {"__cuda_array_interface__": interface})(), device="cuda")
    return alias, "__cuda_array_interface__ (UVA)"


def pcie(nbytes: int, reps: int = 5) -> dict:
    import torch

    # int32 ones summed into int64: exact, so the check below proves the kernel read every host byte
    host = torch.ones(nbytes // 4, dtype=torch.int32, pin_memory=True)  # [n], written so every page is real
    dev = torch.empty_like(host, device="cuda")
    h2d = _timed_cuda(lambda: dev.copy_(host, non_blocking=True), reps)
    alias, how = _device_alias(host)
    result = {}
    zero_copy = _timed_cuda(lambda: result.__setitem__("sum", torch.sum(alias, dtype=torch.int64)), reps)
    if int(result["sum"]) != host.numel():
        raise RuntimeError(f"zero-copy read summed {int(result['sum'])}, expected {host.numel()}: the alias does not read the host buffer")
    return {"pcie_h2d_gbs": nbytes / h2d / 1e9, "pcie_zero_copy_read_gbs": nbytes / zero_copy / 1e9,
            "zero_copy_alias": how, "pcie_bytes": nbytes, **host_store_paths(nbytes, reps)}


@contextlib.contextmanager
def registered_host(nbytes: int):
    """``(host, alias)``: ``nbytes`` of host memory allocated and registered the way the host store's are (anonymous
    mmap + cudaHostRegister, not torch's pinned allocator), every page written, and its device view; None when the
    registration fails."""
    import mmap

    import torch

    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    host = torch.frombuffer(mm, dtype=torch.uint8)
    host.fill_(1)
    if int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, 3)) != 0:
        yield None
        return
    try:
        yield host, _device_alias(host)[0]
    finally:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


TOLERANCE = 0.05  # an emulated rate within this share of its target


def link_emulation(targets, nbytes: int, reps: int = 5) -> dict:
    """The emulated link's rates at each target (GB/s), as ``glm53.offload.link.Link`` holds them."""
    import torch

    from glm53.offload.ec_native import Kernels
    from glm53.offload.link import Link

    with registered_host(nbytes) as registered:
        if registered is None:
            return {"error": "cudaHostRegister failed"}
        host, alias = registered
        link = Link(Kernels(), torch.device("cuda", torch.cuda.current_device()), registered)
        rows = []
        for target in targets:
            link.retarget(target)
            row = {"target_gbs": target, "zero_copy_full_grid_gbs": link.read_rate_gbs(alias, link.sms, reps),
                   "zero_copy_64_blocks_gbs": link.read_rate_gbs(alias, 64, reps), "copy_gbs": link.copy_rate_gbs(host, reps)}
            ratios = {k.removesuffix("_gbs") + "_ratio": v / target for k, v in row.items() if k != "target_gbs"}
            rows.append({**row, **ratios, "valid": all(abs(r - 1) <= TOLERANCE for r in ratios.values())})
        return {"measured": {"zero_copy_gbs": link.rates.zero_copy_gbs, "copy_gbs": link.rates.copy_gbs}, "tolerance": TOLERANCE,
                "targets": rows, "valid": all(r["valid"] for r in rows)}


def host_store_paths(nbytes: int, reps: int = 5) -> dict:
    """The two ways the offload layer moves expert bytes, on memory allocated and registered the way its host store
    is (anonymous mmap + cudaHostRegister, not torch's pinned allocator): copy-engine DMA (prefill staging, elastic
    restore) and a 16-byte-load kernel reading the mapped memory in place (zero-copy misses, admissions), the latter
    at several grid sizes (its thread blocks are taken from the compute kernels while it runs)."""
    import torch

    from glm53.offload.ec_native import Kernels

    with registered_host(nbytes) as registered:
        if registered is None:
            return {"host_store_error": "cudaHostRegister failed"}
        host, alias = registered
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        out = {"pcie_dma_registered_gbs": nbytes / _timed_cuda(lambda: dev.copy_(host, non_blocking=True), reps) / 1e9}
        kernels = Kernels()
        sink = torch.zeros(1, dtype=torch.int32, device="cuda")
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for blocks in (16, 32, 64, sms, 2 * sms, 4 * sms):
            out[f"pcie_sm_read_gbs_{blocks}_blocks"] = nbytes / _timed_cuda(lambda b=blocks: kernels.read_probe(alias, sink, b), reps) / 1e9
        return out


def hbm(nbytes: int, reps: int = 5) -> dict:
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.int32, device="cuda")
    dst = torch.empty_like(src)
    seconds = _timed_cuda(lambda: dst.copy_(src), reps)
    return {"hbm_copy_gbs": 2 * nbytes / seconds / 1e9, "hbm_bytes": nbytes}


def dram(nbytes: int, threads: int) -> dict:
    from glm53.plan import dram_read_gbs

    return {"dram_read_gbs": dram_read_gbs(nbytes, threads), "dram_threads": threads, "dram_bytes": nbytes // 8 * 8}


def measure(gib: float = 1.0, dram_gib: float = 4.0, threads: int | None = None) -> dict:
    from glm53.engine.exl3.core_order import core_order

    threads = threads or core_order()[1]
    out = {}
    out.update(pcie(int(gib * GIB)))
    out.update(hbm(int(gib * GIB)))
    out.update(dram(int(dram_gib * GIB), threads))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.bandwidth", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="PCIe and HBM buffer size in GiB (default 1)")
    ap.add_argument("--dram-gib", type=float, default=4.0, help="host buffer for the DRAM read in GiB (default 4)")
    ap.add_argument("--threads", type=int, help="DRAM read threads (default: one per physical core)")
    ap.add_argument("--out", help="write the JSON here (default: print it)")
    ap.add_argument("--link-emulate-gbs", type=float, nargs="+", help="also check the in-band emulation of a link of these "
                    "rates (GB/s; output: link_emulation)")
    args = ap.parse_args(argv)
    result = measure(args.gib, args.dram_gib, args.threads)
    if args.link_emulate_gbs:
        result["link_emulation"] = link_emulation(args.link_emulate_gbs, int(args.gib * GIB))
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
