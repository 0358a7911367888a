"""The GPU expert cache: VRAM slots holding the hottest routed experts, decided on the device at every decode step.

exllamav3's MoE kernels find each expert's trellises through per-layer int64 pointer tables. An expert in a
slot has its table entries pointed at the slot; every other expert's entries point at its block in the host
store (a mapped, page-locked address), so the kernels read it over PCIe. Bytes never change, only where they
are read from, so results are bit-identical whatever the cache holds.

The replacement policy (per layer, on the device, no host synchronisation) is defined in ``cache_policy``: a
slow decayed pick count per expert (popularity) plus a fast one (recency) weighted by how much the layer's picks
are seen to recur over tokens, admission of a missed expert past a hysteresis over the weakest
resident not in use, at most ``max_admit`` per layer and step, slots partitioned between layers at start by the
routing profile, scores starting from the same profile (the checkpoint's own, else one learned while serving,
else none), so decode starts warm.

Reported: hits and misses per layer, admissions, evictions, and the oracle hit rate: what the best fixed
placement of the same number of slots would have hit on the decode picks actually seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .. import config
from .cache_policy import (C_ADMITS, C_EVICTS, C_HITS, C_N, C_PICKS, C_STEPS, Admission, Recency, ReferenceCache, placement,
                           popularity_lift, warm_scores)
from .ec_native import MAX_ADMIT, MAX_EXPERTS, EcRecency, EcState, Kernels
from .host_store import HostStore
from .link import Link
from .part import Part

CHUNK_SLOTS = 32  # slots per VRAM allocation; the elastic loan frees and reallocates whole chunks


@dataclass(frozen=True)
class Policy:
    """The cache's settings. ``decay``, ``hysteresis``, ``max_admit`` and the ``recency_*`` fields are the
    replacement policy's parameters, defined by ``cache_policy.ReferenceCache.step`` (which ``ec_step_kernel`` runs
    on the device). The defaults are the replay's choice on the real engine's routing trace
    (bench/results/2026-12-02-cache-policy-engine-trace.md), confirmed on the GPU (+3.3 % decode against the policy
    before, 2026-12-02-offload-session5-h200.md). The warm horizon caps how many steps of picks the shipped profile
    counts as: at decay 0.995 its 200 steps are the profile's steady state (no cap), and with a slower decay it lets a
    profile the routing does not follow fade as fast as 0.995's would. The replays' candidate on the engine trace and
    both presets' twins, decay 0.999 / recency weight 400 / hysteresis 1.1 / horizon 200
    (bench/results/2026-12-04-cache-policy-online-bound.md: +0.06, +0.37 and +0.50 points of hit rate), is not the
    default until a GPU A/B confirms it (``--ec-decay 0.999 --ec-recency-weight 400 --ec-hysteresis 1.1``)."""

    decay: float = 0.995  # of the slow score (popularity): half-life ~140 decode steps
    hysteresis: float = 1.25
    max_admit: int = 8  # per layer and decode step; an admission replaces the step's read of the expert over the link
    recency_decay: float = 0.5  # of the fast score: a trained router's picks recur over the next few tokens
    recency_weight: float = 200.0  # the fast score's weight per unit of measured reuse lift above popularity's
    recency_keep: float = 0.99  # of the running reuse lift: ~100 decode steps
    warm_horizon: float | None = 200.0  # decode steps of picks the profile's warm start counts as at most (None: 1 / (1 - decay))
    decode_rows: int = 8  # routing calls of at most this many rows are decode steps (admission on)
    copy_blocks: int = 32  # thread blocks of the admission copy (16 already saturate a PCIe 5 link)

    def __post_init__(self):
        if not 0.0 < self.decay <= 1.0 or self.hysteresis < 1.0 or not 0 <= self.max_admit <= MAX_ADMIT:
            raise ValueError(f"bad cache policy {self}")
        weight_ok = self.recency_weight >= 0.0 and math.isfinite(self.recency_weight)
        if not 0.0 < self.recency_decay < 1.0 or not weight_ok or not 0.0 <= self.recency_keep < 1.0:
            raise ValueError(f"bad cache policy {self}: recency_decay in (0, 1), recency_weight >= 0, recency_keep in [0, 1)")
        if self.warm_horizon is not None and not (self.warm_horizon >= 1.0 and math.isfinite(self.warm_horizon)):
            raise ValueError(f"bad cache policy {self}: warm_horizon at least 1 decode step, or None")

    @classmethod
    def from_settings(cls, settings) -> Policy:
        """The default policy with what ``GLM53_EC_DECAY`` / ``GLM53_EC_HYSTERESIS`` / ``GLM53_EC_RECENCY_WEIGHT`` /
        ``GLM53_EC_WARM_HORIZON`` set (unset: the defaults)."""
        return cls(**config.given(settings, decay="ec_decay", hysteresis="ec_hysteresis", recency_weight="ec_recency_weight",
                                  warm_horizon="ec_warm_horizon"))

    @property
    def recency(self) -> Recency:
        return Recency(self.recency_decay, self.recency_weight, self.recency_keep)


def predicted_admissions(policy: Policy, selected, freq, recent, prev, reuse, slot_of) -> list[Admission]:
    """The admissions the device's next step of a layer makes on ``selected`` (its picks, rows kept), from the
    layer's state as read at the routing's synchronisation (host copies of its rows of ``freq``, ``recent``, ``prev``,
    ``reuse`` and ``slot_of``): ``ReferenceCache.step``, the definition ``ec_step_kernel`` runs (the GPU test
    tests/gpu/test_cache_policy_kernel.py holds them to the same decisions). Each admission's ``evicted`` is the
    expert whose VRAM slot the step then overwrites."""
    slot_of = np.asarray(slot_of)
    state = ReferenceCache.of_layer(freq, recent, prev, reuse, slot_of, int(slot_of.max(initial=-1)) + 1)
    return state.step(0, selected, policy.decay, policy.hysteresis, policy.max_admit, policy.recency)


class ExpertCache(Part):
    name = "cache"

    def __init__(
        self,
        kernels: Kernels,
        store: HostStore,
        tables: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
        slots: int,
        device: torch.device,
        top_k: int,
        policy: Policy | None = None,
        profile: np.ndarray | None = None,
        link: Link | None = None,
        ram_tier=None,
    ):
        """
        :param tables: per MoE layer (in store order), exllamav3's gate, up, down (E,) and gate/up (E, 2) tables.
        :param slots: VRAM slots to allocate (at most every expert).
        :param top_k: experts picked per token (scales the warm-start scores like real picks would).
        :param profile: float [layers, experts] picks per expert, for the partition and the warm start.
        :param link: the host link every part of the offload tells what it moved (default: the full link's, which
            does nothing); the stager, prefetch and the CPU tier use this one too.
        :param ram_tier: where the experts are when host RAM holds only part of them (``ram_tier.RamTier``): slots are
            filled from it (read from disk a layer at a time), not from the host store's arenas.
        """
        self.ram_tier = ram_tier
        self.kernels = kernels
        self.link = link or Link(kernels, device)
        self.store = store
        self.policy = policy or Policy()
        self.device = device
        self.top_k = top_k
        L, E = store.num_layers, store.num_experts
        self.block_bytes = store.layout.block_bytes
        self.num_slots = int(min(max(slots, 0), L * E))
        profile = np.zeros((L, E)) if profile is None else np.asarray(profile, dtype=np.float64)
        if E > MAX_EXPERTS:
            raise ValueError(f"{E} experts per layer; the cache's kernels handle at most {MAX_EXPERTS} (as exllamav3's do)")
        if profile.shape != (L, E):
            raise ValueError(f"routing profile of shape {profile.shape}, expected {(L, E)}")
        self._tables = tables
        i64 = {"dtype": torch.int64, "device": device}
        home = store.home_addresses()  # [L, E]
        self.home_host = home.numpy()  # what staging and verify read, without a device round trip
        self.home = home.to(device)
        self.tables_addr = torch.tensor([[t.data_ptr() for t in layer] for layer in tables], **i64)
        self.freq = torch.zeros((L, E), dtype=torch.float32, device=device)
        self.recent = torch.zeros((L, E), dtype=torch.float32, device=device)
        self.prev = torch.zeros((L, E), dtype=torch.uint8, device=device)
        self.reuse = torch.zeros((L, 2), dtype=torch.float32, device=device)
        self.slot_of = torch.full((L, E), -1, dtype=torch.int32, device=device)
        self.owner = torch.full((max(self.num_slots, 1),), -1, dtype=torch.int32, device=device)
        self.picks = torch.zeros((L, E), **i64)
        self.counters = torch.zeros((L, C_N), **i64)
        self.jobs = torch.zeros((MAX_ADMIT, 2), dtype=torch.int32, device=device)
        self.num_jobs = torch.zeros((1,), dtype=torch.int32, device=device)
        self.chunk_sizes = [min(CHUNK_SLOTS, self.num_slots - first) for first in range(0, self.num_slots, CHUNK_SLOTS)]
        self.chunks: list[torch.Tensor | None] = [torch.empty((n, self.block_bytes), dtype=torch.uint8, device=device) for n in self.chunk_sizes]
        self.slot_addr = torch.zeros((max(self.num_slots, 1),), **i64)
        self._refresh_slot_addr()
        self.state = EcState(
            num_layers=L, num_experts=E,
            freq=self.freq.data_ptr(), slot_of=self.slot_of.data_ptr(), owner=self.owner.data_ptr(),
            picks=self.picks.data_ptr(), counters=self.counters.data_ptr(), home=self.home.data_ptr(),
            slot_addr=self.slot_addr.data_ptr(), tables=self.tables_addr.data_ptr(),
            off_up=store.layout.offsets[1], off_down=store.layout.offsets[2],
            jobs=self.jobs.data_ptr(), num_jobs=self.num_jobs.data_ptr(),
        )
        self.recency_state = EcRecency(recent=self.recent.data_ptr(), prev=self.prev.data_ptr(), reuse=self.reuse.data_ptr(),
                                       decay=self.policy.recency_decay, weight=self.policy.recency_weight, keep=self.policy.recency_keep)
        # Table entries at home first (exllamav3 built them from the same aliases; this makes it explicit)
        self.assign([(l, e, -1) for l in range(L) for e in range(E)])
        self._lent: list[int] = []  # chunks freed for a prefill
        self._lent_experts: list[tuple[int, int, int]] = []  # (layer, expert, slot) they held
        self.elastic = {"enter": 0, "exit": 0, "lent_bytes": 0, "restored_experts": 0, "realloc_failures": 0}
        self.quota = np.zeros(L, dtype=np.int64)
        self._warm_start(profile)

    # ---- setup

    def _refresh_slot_addr(self) -> None:
        addrs = []
        for chunk, n in zip(self.chunks, self.chunk_sizes):
            base = 0 if chunk is None else chunk.data_ptr()  # a lent chunk: no expert points there
            addrs += [base + i * self.block_bytes for i in range(n)]
        if addrs:
            self.slot_addr[: len(addrs)].copy_(torch.tensor(addrs, dtype=torch.int64))

    def _warm_start(self, profile: np.ndarray) -> None:
        """Fill the slots by ``placement``, hottest first (slot 0 = globally hottest), which partitions them
        between layers for good; the elastic loan, which takes the last chunks, so takes the coldest residents."""
        entries = [(l, e, slot) for slot, (l, e) in enumerate(placement(profile, self.num_slots))]
        for l, _, slot in entries:
            self.quota[l] += 1
        self.assign(entries)
        self.copy_in([(l, e, slot) for l, e, slot in entries])
        self.freq.copy_(torch.from_numpy(warm_scores(profile, self.top_k, self.policy.decay, self.policy.warm_horizon)))
        self.recent.copy_(torch.from_numpy(warm_scores(profile, self.top_k, self.policy.recency_decay, self.policy.warm_horizon)))
        self.reuse.copy_(torch.from_numpy(np.repeat(popularity_lift(profile, self.top_k)[:, None], 2, axis=1)))
        torch.cuda.synchronize(self.device)

    def assign(self, entries: list[tuple[int, int, int]]) -> None:
        """Point experts at slots (slot -1: back to the host store); table and bookkeeping only, no bytes."""
        if not entries:
            return
        t = torch.tensor(entries, dtype=torch.int32).to(self.device, non_blocking=False)
        self.kernels.assign(self.state, t)

    def copy_out(self, slot: int, dest: torch.Tensor) -> None:
        """Queue a copy of the expert block in VRAM slot ``slot`` to ``dest`` (a page-locked CPU uint8 tensor of one
        block: the RAM tier's arena) on the current stream, so that it runs before any later step that may overwrite
        the slot (``copy_in``'s way back)."""
        dest.copy_(self.chunks[slot // CHUNK_SLOTS][slot % CHUNK_SLOTS], non_blocking=True)

    def copy_in(self, entries: list[tuple[int, int, int]]) -> None:
        """Copy experts' blocks from host memory (the host store, or the RAM tier's window) into their slots with the
        copy engine (DMA)."""
        for (l, e, slot), block in self._host_blocks(entries):
            chunk = self.chunks[slot // CHUNK_SLOTS]
            chunk[slot % CHUNK_SLOTS].copy_(block, non_blocking=True)

    def _host_blocks(self, entries: list):
        """(entry, its expert's block in host memory) for entries whose first two fields are (layer, expert). With a
        RAM tier the blocks are read from disk into its window a layer at a time: what was done with one layer's
        blocks must be queued before the next is asked for (the window is reused once the device is done with it)."""
        if self.ram_tier is None:
            for entry in entries:
                yield entry, self.store.host_block(entry[0], entry[1])
            return
        from_disk = []
        for entry in entries:  # those in the tier's policy slots from RAM (after an elastic loan, most are not)
            held = self.ram_tier.policy_block(entry[0], entry[1])
            if held is None:
                from_disk.append(entry)
            else:
                yield entry, torch.from_numpy(held)
        wait = lambda: torch.cuda.synchronize(self.device)
        for indices, blocks in self.ram_tier.batches([(entry[0], entry[1]) for entry in from_disk], wait):
            for i, block in zip(indices, blocks):
                yield from_disk[i], torch.from_numpy(block)

    # ---- the decode path

    def routed(self, layer: int, selected: torch.Tensor, weights: torch.Tensor | None = None, z: torch.Tensor | None = None) -> None:
        """After a layer's routing, before its experts run: count, decide, rewrite tables, copy admissions (one
        ``cache_policy.ReferenceCache.step``, on the device). The router's weights and input are not needed."""
        admit = self.policy.max_admit if self.num_slots else 0
        self.kernels.step(self.state, self.recency_state, layer, selected, self.policy.decay, self.policy.hysteresis, admit, self.block_bytes,
                          self.policy.copy_blocks)
        if admit:
            self.link.units(self.num_jobs, self.block_bytes, "admissions", self.policy.copy_blocks)

    # ---- the elastic loan (a long prefill borrows cache VRAM for activations and staging)

    def lend(self, nbytes: int) -> int:
        """Free the last (coldest) chunks covering ``nbytes``: their experts go back to the host store's
        addresses and are remembered for ``restore``. Returns the bytes freed. Synchronises (prefill start)."""
        owners = self.owners()
        freed = 0
        evicted = []
        for c in range(len(self.chunks) - 1, -1, -1):
            if freed >= nbytes:
                break
            chunk = self.chunks[c]
            if chunk is None:
                continue
            for slot in range(c * CHUNK_SLOTS, c * CHUNK_SLOTS + chunk.shape[0]):
                le = int(owners[slot])
                if le >= 0:
                    evicted.append((le // self.store.num_experts, le % self.store.num_experts, slot))
            freed += chunk.numel()
            self._lent.append(c)
        if freed == 0:
            return 0
        if evicted:
            self.assign([(l, e, -1) for l, e, _ in evicted])
        torch.cuda.current_stream(self.device).synchronize()  # no kernel may still read the slots
        for c in self._lent:
            self.chunks[c] = None
        self._refresh_slot_addr()
        self._lent_experts += evicted
        self.elastic["enter"] += 1
        self.elastic["lent_bytes"] = freed
        return freed

    def restore(self) -> None:
        """Reallocate the lent chunks and put back the experts they held (copied by DMA), so decode after a
        long prefill starts with the same residents as before it. A chunk that cannot be reallocated stays
        off (its slots unused, counted)."""
        if not self._lent:
            return
        back = set()
        for c in self._lent:
            try:
                self.chunks[c] = torch.empty((self.chunk_sizes[c], self.block_bytes), dtype=torch.uint8, device=self.device)
                back.add(c)
            except torch.OutOfMemoryError:
                self.elastic["realloc_failures"] += 1
        self._refresh_slot_addr()
        entries = [(l, e, s) for l, e, s in self._lent_experts if s // CHUNK_SLOTS in back]
        self.assign(entries)
        self.copy_in(entries)
        self.link.copied(len(entries) * self.block_bytes)
        self.elastic["exit"] += 1
        self.elastic["restored_experts"] += len(entries)
        self._lent = [c for c in self._lent if c not in back]
        self._lent_experts = [x for x in self._lent_experts if x[2] // CHUNK_SLOTS not in back]

    @property
    def lent(self) -> bool:
        return bool(self._lent)

    # ---- reading back

    def resident(self) -> np.ndarray:
        """int32 [layers, experts]: slot of each expert, -1 if read from the host store (synchronises)."""
        return self.slot_of.cpu().numpy()

    def owners(self) -> np.ndarray:
        return self.owner.cpu().numpy()[: self.num_slots]

    def learned_profile(self) -> np.ndarray:
        return self.picks.cpu().numpy().astype(np.float64)

    def stats(self) -> dict:
        counters = self.counters.cpu().numpy()
        picks = self.picks.cpu().numpy()
        per_layer = []
        for l, key in enumerate(self.store.layer_keys):
            n, h = int(counters[l, C_PICKS]), int(counters[l, C_HITS])
            top = np.sort(picks[l])[::-1][: int(self.quota[l])].sum() if n else 0
            per_layer.append({
                "layer": key, "slots": int(self.quota[l]), "picks": n, "hits": h,
                "hit_rate": round(h / n, 4) if n else None,
                "oracle_hit_rate": round(float(top) / n, 4) if n else None,
                "admissions": int(counters[l, C_ADMITS]), "evictions": int(counters[l, C_EVICTS]),
            })
        total_picks = int(counters[:, C_PICKS].sum())
        total_hits = int(counters[:, C_HITS].sum())
        flat = np.sort(picks.reshape(-1))[::-1]
        oracle = float(flat[: self.num_slots].sum()) / total_picks if total_picks else None
        live = sum(c.shape[0] for c in self.chunks if c is not None)
        return {
            "slots": self.num_slots,
            "slots_allocated": live,
            "slot_bytes": self.block_bytes,
            "cache_bytes": live * self.block_bytes,
            "experts_total": self.store.num_layers * self.store.num_experts,
            "decode_steps": int(counters[:, C_STEPS].max()) if len(counters) else 0,
            "picks": total_picks,
            "hits": total_hits,
            "misses": total_picks - total_hits,
            "hit_rate": round(total_hits / total_picks, 4) if total_picks else None,
            "oracle_hit_rate": round(oracle, 4) if oracle is not None else None,
            "admissions": int(counters[:, C_ADMITS].sum()),
            "evictions": int(counters[:, C_EVICTS].sum()),
            "elastic": dict(self.elastic),
            "per_layer": per_layer,
        }

    def verify(self) -> list[str]:
        """Consistency check (synchronises): tables point at slots exactly for resident experts, and every
        resident expert's slot holds its bytes. Returns the problems found."""
        problems = []
        slot_of = self.resident()
        home = self.home_host
        addrs = self.slot_addr.cpu().numpy()
        offs = self.store.layout.offsets
        resident = [(l, e, int(slot_of[l, e])) for l in range(len(self._tables)) for e in range(self.store.num_experts) if slot_of[l, e] >= 0]
        for (l, e, s), block in self._host_blocks(resident):
            chunk = self.chunks[s // CHUNK_SLOTS]
            if chunk is None or not torch.equal(chunk[s % CHUNK_SLOTS].cpu(), block):
                problems.append(f"layer {l} expert {e}: slot {s} does not hold its bytes")
        for l, layer in enumerate(self._tables):
            g, u, d, gu = (t.cpu().numpy() for t in layer)
            for e in range(self.store.num_experts):
                s = slot_of[l, e]
                base = home[l, e] if s < 0 else addrs[s]
                want = (base + offs[0], base + offs[1], base + offs[2])
                got = (g[e], u[e], d[e])
                if got != want or tuple(gu[e]) != want[:2]:
                    problems.append(f"layer {l} expert {e}: tables {got} want {want}")
        return problems
