"""The host store: every routed expert's trellises once, in page-locked host memory the GPU can read directly.

One arena per MoE layer, exactly the size of that layer's expert trellises (no power-of-two rounding as with
torch's pinned allocator), laid out expert by expert as ``[gate | up | down]`` blocks, each projection at a
256-byte aligned offset. The same layout is used for the VRAM slots of the expert cache, so admitting an expert
is one contiguous copy. Shard bytes are read straight into the arena with ``preadv`` (no staging copy), by a
few threads because a single reader does not saturate a fast disk or the page cache.

After ``pin_and_map`` the arenas are registered with CUDA as mapped memory; ``trellis_view`` then gives a CUDA
tensor aliasing an expert's trellis in host memory, which exllamav3 takes as the expert's weight: its MoE
kernels read such an expert over PCIe with no copy and no host synchronisation (zero-copy).

The small per-expert ``suh``/``svh`` vectors are not stored here; exllamav3 keeps them in VRAM.
"""

from __future__ import annotations

import mmap
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import GB
from ..models.checkpoint import shards
from ..models.safetensors_header import read_header

PROJECTIONS = ("gate", "up", "down")
ALIGN = 256  # byte alignment of each projection inside an expert block (exllamav3's kernels load 16 B vectors)
EXPERT_SIGN_SCALE = re.compile(r"^(?P<layer>.*\.layers\.\d+\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.(?P<which>suh|svh)$")
EXPERT_TRELLIS = re.compile(r"^(?P<layer>.*\.layers\.(?P<index>\d+)\.mlp)\.experts\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.trellis$")
READ_THREADS = 8
READ_CHUNK = 64 * 1024**2  # one preadv call; bounded so a short read is retried at a known place
CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02


@dataclass(frozen=True)
class ExpertLayout:
    """Where each projection's trellis sits inside one expert block (the same in host memory and VRAM slots)."""

    shapes: tuple[tuple[int, ...], ...]  # per projection, the int16 trellis shape
    nbytes: tuple[int, ...]
    offsets: tuple[int, ...]
    block_bytes: int

    @classmethod
    def from_shapes(cls, shapes: tuple[tuple[int, ...], ...]) -> ExpertLayout:
        nbytes = tuple(int(np.prod(s)) * 2 for s in shapes)
        offsets, at = [], 0
        for n in nbytes:
            offsets.append(at)
            at += -(-n // ALIGN) * ALIGN
        return cls(shapes, nbytes, tuple(offsets), at)


@dataclass(frozen=True)
class _Source:
    file: Path
    offset: int  # absolute byte offset of the tensor in the file
    nbytes: int


class HostStore:
    """The routed experts of every MoE layer of a checkpoint, in one exact-size host arena per layer."""

    def __init__(self, layer_keys: list[str], num_experts: int, layout: ExpertLayout, sources: dict[tuple[int, int, int], _Source]):
        self.layer_keys = layer_keys  # exllamav3 module keys, e.g. model.language_model.layers.3.mlp
        self.num_experts = num_experts
        self.layout = layout
        self._sources = sources  # (layer row, expert, projection) -> where its bytes are in the shards
        self._rows = {key: row for row, key in enumerate(layer_keys)}
        self._maps: list[mmap.mmap] = []
        self.arenas: list[torch.Tensor] = []  # per layer: uint8 [num_experts * block_bytes], CPU
        self._cuda_arenas: list[torch.Tensor] = []
        self._registered = False
        self.tiered = False  # the experts are in a RAM tier (``alias_window``), not in arenas of this store

    # ---- building

    @classmethod
    def scan(cls, model_dir: Path) -> HostStore:
        """The store's plan from the checkpoint's safetensors headers (no tensor data is read).

        :raise ValueError: no routed experts, experts of one layer or of different layers with different
            shapes, a missing projection, or a trellis that is not int16.
        """
        sources: dict[tuple[str, int, str], _Source] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for shard in shards(Path(model_dir)):
            header, data_start = read_header(shard)
            for name, entry in header.items():
                m = EXPERT_TRELLIS.match(name)
                if not m:
                    continue
                if entry["dtype"] != "I16":
                    raise ValueError(f"{name}: trellis dtype {entry['dtype']}, expected I16")
                begin, end = entry["data_offsets"]
                proj = m["proj"]
                shape = tuple(entry["shape"])
                if shapes.setdefault(proj, shape) != shape:
                    raise ValueError(f"{name}: trellis shape {shape} differs from {shapes[proj]} of the other {proj} projections")
                sources[(m["layer"], int(m["expert"]), proj)] = _Source(shard, data_start + begin, end - begin)
        if not sources:
            raise ValueError(f"{model_dir}: no routed expert trellises (…mlp.experts.N.gate_proj.trellis) in the checkpoint")
        missing_proj = [p for p in PROJECTIONS if p not in shapes]
        if missing_proj:
            raise ValueError(f"{model_dir}: routed experts have no {', '.join(missing_proj)} projection")
        layers = sorted({k[0] for k in sources}, key=lambda key: int(re.search(r"layers\.(\d+)\.mlp$", key).group(1)))
        num_experts = 1 + max(k[1] for k in sources)
        for layer in layers:
            for e in range(num_experts):
                for p in PROJECTIONS:
                    if (layer, e, p) not in sources:
                        raise ValueError(f"{model_dir}: {layer}.experts.{e}.{p}_proj.trellis is missing")
        layout = ExpertLayout.from_shapes(tuple(shapes[p] for p in PROJECTIONS))
        rows = {key: row for row, key in enumerate(layers)}
        by_row = {(rows[layer], e, PROJECTIONS.index(p)): src for (layer, e, p), src in sources.items()}
        return cls(layers, num_experts, layout, by_row)

    @property
    def num_layers(self) -> int:
        return len(self.layer_keys)

    @property
    def arena_bytes(self) -> int:
        """Host bytes of all arenas."""
        return self.num_layers * self.num_experts * self.layout.block_bytes

    @property
    def trellis_bytes(self) -> int:
        """Bytes of the experts' trellises in the checkpoint (what the arenas hold, without alignment)."""
        return self.num_layers * self.num_experts * sum(self.layout.nbytes)

    def load(self, threads: int = READ_THREADS, progress: Callable[[int, int], None] | None = None) -> float:
        """Allocate the arenas and read every expert trellis into them; returns the seconds it took.

        :param progress: called with (bytes read, bytes to read) as the reads complete.
        :raise OSError: a shard that cannot be read, or a short read.
        """
        import time

        t0 = time.monotonic()
        for _ in range(self.num_layers):
            size = self.num_experts * self.layout.block_bytes
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
                mm.madvise(mmap.MADV_HUGEPAGE)  # fewer page-table entries to pin and for the IOMMU to walk
            self._maps.append(mm)
            self.arenas.append(torch.frombuffer(mm, dtype=torch.uint8))
        jobs = sorted(self._sources.items(), key=lambda kv: (str(kv[1].file), kv[1].offset))  # file order
        done = 0
        total = sum(src.nbytes for _, src in jobs)
        if progress is not None:
            progress(0, total)
        fds: dict[Path, int] = {}
        try:
            for file in {src.file for _, src in jobs}:
                fds[file] = os.open(file, os.O_RDONLY)
            with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
                for nbytes in pool.map(lambda job: self._read(fds[job[1].file], job[0], job[1]), jobs):
                    done += nbytes
                    if progress is not None:
                        progress(done, total)
        finally:
            for fd in fds.values():
                os.close(fd)
        return time.monotonic() - t0

    def _read(self, fd: int, where: tuple[int, int, int], src: _Source) -> int:
        """Read one trellis into its place; returns its bytes."""
        row, expert, proj = where
        begin = expert * self.layout.block_bytes + self.layout.offsets[proj]
        view = memoryview(self._maps[row])[begin : begin + src.nbytes]
        got = 0
        while got < src.nbytes:
            n = os.preadv(fd, [view[got : min(src.nbytes, got + READ_CHUNK)]], src.offset + got)
            if n <= 0:
                raise OSError(f"{src.file}: short read at byte {src.offset + got} (expert {expert} of {self.layer_keys[row]})")
            got += n
        return got

    # ---- the GPU side

    def pin_and_map(self, device: torch.device, register: Callable[[int, int], None], device_view: Callable[[torch.Tensor, int], torch.Tensor],
                    progress: Callable[[int, int], None] | None = None) -> None:
        """Register every arena with CUDA as mapped memory and make the CUDA aliases.

        :param register: ``(address, nbytes)`` -> page-locks and maps that range (cudaHostRegister).
        :param device_view: (pinned CPU tensor, device index) -> a CUDA tensor aliasing it.
        :param progress: called with (bytes pinned, bytes to pin), before the first arena and after each.
        """
        total = sum(arena.numel() for arena in self.arenas)
        done = 0
        if progress is not None:
            progress(0, total)
        for arena in self.arenas:
            register(arena.data_ptr(), arena.numel())
            done += arena.numel()
            if progress is not None:
                progress(done, total)
        self._registered = True
        self._cuda_arenas = [device_view(arena, device.index or 0) for arena in self.arenas]

    def probe_region(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's pinned host bytes and their CUDA alias, for measuring the link: the first arena, or with a RAM
        tier its window."""
        return (self._window_host, self._cuda_arenas[0]) if self.tiered else (self.arenas[0], self._cuda_arenas[0])

    def alias_window(self, window: torch.Tensor, window_host: torch.Tensor) -> None:
        """With a RAM tier instead of :meth:`load`: every layer's experts alias ``window`` (the tier's CUDA uint8 alias
        of one layer's blocks, expert by expert; ``window_host`` the same bytes on the host), so the model loads with valid expert addresses and
        :meth:`home_addresses` starts there; the tier points each expert at its real place before a kernel reads it."""
        if window.numel() != self.num_experts * self.layout.block_bytes:
            raise ValueError(f"a window of {window.numel()} bytes; one layer's experts take {self.num_experts * self.layout.block_bytes}")
        self._cuda_arenas = [window] * self.num_layers
        self._window_host = window_host
        self.tiered = True

    def unpin(self, unregister: Callable[[int], None]) -> None:
        """Undo :meth:`pin_and_map` (``unregister``: :func:`cuda_unregister`, or a test's stand-in)."""
        if self._registered:
            for arena in self.arenas:
                unregister(arena.data_ptr())
            self._registered = False
        self._cuda_arenas = []

    def trellis_view(self, tensor_key: str) -> torch.Tensor | None:
        """The CUDA alias of an expert trellis by its checkpoint name, or None if the store does not hold it."""
        m = EXPERT_TRELLIS.match(tensor_key)
        if not m or not self._cuda_arenas:
            return None
        row = self._rows.get(m["layer"])
        if row is None:
            return None
        proj = PROJECTIONS.index(m["proj"])
        begin = int(m["expert"]) * self.layout.block_bytes + self.layout.offsets[proj]
        flat = self._cuda_arenas[row][begin : begin + self.layout.nbytes[proj]]
        return flat.view(torch.int16).view(self.layout.shapes[proj])

    def cuda_arena(self, row: int) -> torch.Tensor:
        """A layer's whole arena as a CUDA uint8 alias (after ``pin_and_map``): what the GPU reads over the link."""
        return self._cuda_arenas[row]

    def host_block(self, row: int, expert: int) -> torch.Tensor:
        """The expert's ``[gate | up | down]`` block in host memory (a CPU tensor; pinned after ``pin_and_map``).

        :raise RuntimeError: a RAM tier holds the experts (``alias_window``): they are read through it."""
        if self.tiered:
            raise RuntimeError("the experts are in a RAM tier, not in the host store: read them through it")
        b = self.layout.block_bytes
        return self.arenas[row][expert * b : (expert + 1) * b]

    def home_addresses(self) -> torch.Tensor:
        """int64 [layers, experts]: the device address of each expert block (valid after ``pin_and_map``)."""
        base = torch.tensor([a.data_ptr() for a in self._cuda_arenas], dtype=torch.int64)
        return base[:, None] + torch.arange(self.num_experts, dtype=torch.int64)[None, :] * self.layout.block_bytes

    def read_sign_scale(self, model_dir: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """fp16 copies of every routed expert's input and output sign/scale vectors, for the CPU tier (exllamav3
        keeps its own in VRAM): ``{projection: (suh [layers, experts, in], svh [layers, experts, out])}``.

        :raise ValueError: a vector that is missing, not fp16, or of the wrong length.
        """
        dims = {p: (shape[0] * 16, shape[1] * 16) for p, shape in zip(PROJECTIONS, self.layout.shapes)}
        L, E = self.num_layers, self.num_experts
        out = {p: (np.zeros((L, E, n_in), np.float16), np.zeros((L, E, n_out), np.float16)) for p, (n_in, n_out) in dims.items()}
        seen = np.zeros((L, E, len(PROJECTIONS), 2), bool)
        for shard in shards(Path(model_dir)):
            header, data_start = read_header(shard)
            with open(shard, "rb") as f:
                for name, entry in header.items():
                    m = EXPERT_SIGN_SCALE.match(name)
                    row = self._rows.get(m["layer"]) if m else None
                    if row is None or int(m["expert"]) >= E:
                        continue
                    which = ("suh", "svh").index(m["which"])
                    want = dims[m["proj"]][which]
                    if entry["dtype"] != "F16" or int(np.prod(entry["shape"])) != want:
                        raise ValueError(f"{name}: {entry['dtype']} {entry['shape']}, expected F16 of {want} values")
                    begin, end = entry["data_offsets"]
                    f.seek(data_start + begin)
                    out[m["proj"]][which][row, int(m["expert"])] = np.frombuffer(f.read(end - begin), np.float16)
                    seen[row, int(m["expert"]), PROJECTIONS.index(m["proj"]), which] = True
        if not seen.all():
            row, e, p, which = (int(v) for v in np.argwhere(~seen)[0])
            raise ValueError(f"{model_dir}: {self.layer_keys[row]}.experts.{e}.{PROJECTIONS[p]}_proj.{('suh', 'svh')[which]} is missing")
        return out

    def shard_files(self) -> list[Path]:
        """The checkpoint files holding expert trellises, in path order."""
        return sorted({src.file for src in self._sources.values()}, key=str)

    def block_sources(self, row: int, expert: int) -> list[tuple[Path, int, int, int]]:
        """Where an expert block's projections are on disk: per projection ``(file, file offset, bytes, offset in the
        block)``, what a disk read of the block asks for."""
        return [(src.file, src.offset, src.nbytes, self.layout.offsets[p])
                for p in range(len(PROJECTIONS)) for src in [self._sources[(row, expert, p)]]]

    def describe(self) -> dict:
        return {
            "layers": self.num_layers,
            "experts_per_layer": self.num_experts,
            "expert_block_bytes": self.layout.block_bytes,
            "arena_bytes": self.arena_bytes,
            "trellis_bytes": self.trellis_bytes,
            "pinned": self._registered,
            "ram_tier": self.tiered,
        }


def cuda_register(address: int, nbytes: int) -> None:
    """Page-lock and map host memory for the GPU (``cudaHostRegister``, portable and mapped): what
    :meth:`HostStore.pin_and_map` registers the arenas with.

    :raise RuntimeError: the registration failed (page-locked memory is limited: ``ulimit -l``).
    """
    err = torch.cuda.cudart().cudaHostRegister(address, nbytes, CUDA_HOST_REGISTER_PORTABLE_MAPPED)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / GB:.2f} GB of expert memory failed (error {int(err)}): "
                           "page-locked memory is limited (ulimit -l; set memlock to unlimited)")


def cuda_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)
