"""Write a synthetic GLM-5.3-Flash checkpoint, and rewrite its router biases in place.

``write_checkpoint`` sizes the checkpoint from its tensor plan, refuses a non-empty directory (unless forced)
or a disk without room, fits the router biases to the routing profile, then writes the JSON files, the
tokenizer and the safetensors shards (tensors streamed chunk by chunk from the random pool) and the index.
Everything written is a function of the arguments: the same arguments give byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from glm53 import __version__

from ...progress import Progress
from ...models.checkpoint import ROUTING_PROFILE_FILE
from ...models.safetensors_header import read_header
from . import metadata, router, routing, tokenizer_files
from .presets import SCALES, ModelShape, Scales, resolve
from .random_pool import RandomSource, name_key
from .safetensors_file import open_shard, overwrite_tensor
from .tensors import PREFIX, TensorSpec, average_bits, plan

SHARD_BYTES = 4 * 1000**3
INDEX_NAME = "model.safetensors.index.json"
PROFILE_NAME = "glm53-flash-routing-profile.json"
DEFAULT_PROFILE = Path(__file__).resolve().parents[2] / "models" / PROFILE_NAME  # package data (glm53 plan reads it too)
JSON_FILES = ("config.json", "generation_config.json", "processor_config.json", "tokenizer.json", "tokenizer_config.json")
BIAS_SUFFIX = ".mlp.gate.e_score_correction_bias"
JSON_ALLOWANCE = 16 * 1024**2  # disk for the JSON files (the tokenizer is ~4 MB)


@dataclass
class WriteReport:
    out_dir: Path
    files: list[Path] = field(default_factory=list)
    weight_bytes: int = 0
    tensors: int = 0
    fit_seconds: float = 0.0
    write_seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Bytes of shards written per second of writing them."""
        return self.weight_bytes / max(self.write_seconds, 1e-9)


def write_checkpoint(
    out_dir: Path,
    preset: str = "tiny",
    seed: int = 0,
    moe_layers: int | None = None,
    routing_preset: str = "random",
    profile: Path | None = None,
    force: bool = False,
    stats_out: Path | None = None,
    shard_bytes: int = SHARD_BYTES,
    scales: Scales = SCALES,
    log: Callable[[str], None] = print,
    progress: Progress | None = None,
) -> WriteReport:
    """Write the checkpoint of ``preset`` (``--moe-layers`` MoE layers if given) into ``out_dir``.

    :param routing_preset: the routing dynamics (``routing.PRESETS``): ``random`` or ``trained``.
    :param profile: routing profile JSON; default ``glm53/models/glm53-flash-routing-profile.json``.
    :param force: write into a non-empty directory, first deleting what a previous run would have left
        there (``*.safetensors``, the index, the JSON files); other files are kept.
    :param stats_out: also write the per-layer target counts as an ``EXL3_MOE_CPU_SPLIT_STATS`` file.
    :param progress: where writing the shards reports its bytes, tensor by tensor.
    :raise FileExistsError: ``out_dir`` is not empty and ``force`` is false.
    :raise OSError: not enough free disk space, or no routing profile.
    :raise ValueError: an unknown preset, routing preset or bad layer count.
    """
    out_dir = Path(out_dir)
    shape = resolve(preset, moe_layers)
    dynamics = routing.resolve(routing_preset).dynamics
    source = RandomSource(seed)
    profile = Path(profile) if profile is not None else DEFAULT_PROFILE
    if not profile.is_file():
        raise FileNotFoundError(f"routing profile {profile} not found; pass --profile PATH")
    sizing = plan(shape, scales)  # with zero router biases: the sizes are all it is for
    log(f"glm53 synth: preset {preset}, {shape.layers} layers ({shape.moe_layers} MoE, {shape.experts} experts), "
        f"{routing_preset} routing, {len(sizing)} tensors")
    _make_room(out_dir, force, sum(s.nbytes for s in sizing) + JSON_ALLOWANCE, log)

    report = WriteReport(out_dir)
    started = time.perf_counter()
    profile_data = router.load_profile(profile)
    real_layers = router.layer_map(shape.moe_layers)
    targets = router_targets(shape, profile_data)
    biases = fit_biases(shape, targets, scales, seed, dynamics)
    report.fit_seconds = time.perf_counter() - started
    log(f"  router biases fitted for {len(biases)} layers in {report.fit_seconds:.1f} s")
    gates = None if dynamics is None else {
        i: routing.gate_weight(seed, i, shape.experts, shape.hidden, dynamics, scales.router_sigma)
        for i in shape.moe_layer_indices}

    synth = _synth_record(preset, seed, shape, scales, profile, real_layers, routing_preset)
    report.files += _write_json_files(out_dir, shape, synth)
    specs = plan(shape, scales, biases, gates)
    report.files += _write_shards(out_dir, specs, shard_bytes, source, report, log, progress or Progress())
    # The routing the biases were fitted to ships with the checkpoint: the expert cache warm-starts from it
    text = json.dumps(shipped_profile(shape, profile_data)) + "\n"
    (out_dir / ROUTING_PROFILE_FILE).write_text(text)
    report.files.append(out_dir / ROUTING_PROFILE_FILE)
    if stats_out is not None:
        Path(stats_out).write_text(text)
        log(f"  routing targets for EXL3_MOE_CPU_SPLIT_STATS: {stats_out}")
    log(f"wrote {len(report.files)} files, {report.tensors} tensors, {report.weight_bytes / 1e9:.2f} GB of weights "
        f"in {report.write_seconds:.1f} s ({report.rate / 1e9:.2f} GB/s; {time.perf_counter() - started:.1f} s in all)")
    return report


def _make_room(out_dir: Path, force: bool, needed: int, log: Callable[[str], None]) -> None:
    """Check ``out_dir`` can take ``needed`` bytes, then create it or clear the previous checkpoint from it.

    :raise FileExistsError: ``out_dir`` is not empty and ``force`` is false.
    :raise OSError: not enough free space (counting what ``force`` would delete).
    """
    stale = _stale_files(out_dir, force)
    free = _free_bytes(out_dir) + sum(p.stat().st_size for p in stale)
    log(f"  needs {needed / 1e9:.2f} GB of disk, {free / 1e9:.1f} GB free for {out_dir}")
    if needed > free:
        raise OSError(f"not enough disk space for {out_dir}: need {needed / 1e9:.2f} GB, {free / 1e9:.2f} GB free")
    for path in stale:
        path.unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def _stale_files(out_dir: Path, force: bool) -> list[Path]:
    """Files of an earlier checkpoint in ``out_dir`` that ``force`` replaces (other files are left alone).

    :raise FileExistsError: ``out_dir`` is not empty and ``force`` is false.
    """
    existing = list(out_dir.iterdir()) if out_dir.is_dir() else []
    if existing and not force:
        raise FileExistsError(f"{out_dir} is not empty; pass --force to overwrite the checkpoint there")
    return [p for p in existing
            if p.name.endswith((".safetensors", ".safetensors.partial")) or p.name in (INDEX_NAME, ROUTING_PROFILE_FILE, *JSON_FILES)]


def _free_bytes(out_dir: Path) -> int:
    """Free space on the filesystem ``out_dir`` is (or will be) on."""
    path = out_dir.absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def router_targets(shape: ModelShape, profile_data: dict[str, list[float]]) -> dict[int, np.ndarray]:
    """MoE layer index -> the per-expert pick shares its router is fitted to (``router.target_shares``)."""
    real_layers = router.layer_map(shape.moe_layers)
    return {i: router.target_shares(profile_data, real, shape.experts) for i, real in zip(shape.moe_layer_indices, real_layers)}


def shipped_profile(shape: ModelShape, profile_data: dict[str, list[float]]) -> dict[str, list[float]]:
    """The routing profile a checkpoint of ``shape`` ships with (``ROUTING_PROFILE_FILE``): each MoE layer's
    ``router_targets`` as pick counts totalling its real layer's, under its own layer key."""
    targets = router_targets(shape, profile_data)
    return {router.profile_key(i): router.stats_counts(targets[i], router.profile_total(profile_data, real))
            for i, real in zip(shape.moe_layer_indices, router.layer_map(shape.moe_layers))}


def fit_biases(shape: ModelShape, targets: Mapping[int, np.ndarray], scales: Scales, seed: int,
               dynamics: routing.Dynamics | None = None) -> dict[int, np.ndarray]:
    """MoE layer index -> the selection bias under which the router of ``dynamics`` picks by ``targets``.

    One sample serves every layer. For i.i.d. logits (``dynamics`` None) the layers differ only in their targets;
    with dynamics each layer scores the same routing states with its own gate directions, since expert logits that
    share a low-rank state are correlated and the top-k cut is not the i.i.d. one.
    """
    if dynamics is None:
        rng = np.random.Generator(np.random.Philox(key=name_key(seed, "router-fit")))
        scores = router.sample_scores(rng, router.FIT_TOKENS, shape.experts, scales.router_sigma)
        return {i: router.fit_bias(t, shape.top_k, scores, scales.router_sigma) for i, t in targets.items()}
    states = routing.fit_states(seed, router.FIT_TOKENS, dynamics.rank)
    biases = {}
    for i, t in targets.items():
        scores = routing.fit_scores(states, routing.expert_directions(seed, i, shape.experts, dynamics.rank), scales.router_sigma)
        biases[i] = router.fit_bias(t, shape.top_k, scores, scales.router_sigma)
    return biases


def _synth_record(preset: str, seed: int, shape: ModelShape, scales: Scales, profile: Path,
                  real_layers: list[int], routing_preset: str) -> dict:
    record = {
        "preset": preset,
        "seed": seed,
        "glm53_version": __version__,
        "moe_layers": shape.moe_layers,
        "routing_profile": {
            "file": profile.name,
            "sha256": hashlib.sha256(profile.read_bytes()).hexdigest(),
            # synthetic MoE layer -> the real layer whose expert popularity it takes
            "layer_map": {str(i): real for i, real in zip(shape.moe_layer_indices, real_layers)},
            "expert_map": f"expert i takes real expert floor(i * 288 / {shape.experts})",
            "router_sigma": scales.router_sigma,
        },
        "scales": asdict(scales),
    }
    dynamics = routing.record(routing_preset)
    if dynamics is not None:
        record["routing"] = dynamics
    return record


def _write_json_files(out_dir: Path, shape: ModelShape, synth: dict) -> list[Path]:
    documents = {
        "config.json": metadata.config_json(shape, average_bits(shape), synth),
        "generation_config.json": metadata.generation_config(),
        "processor_config.json": metadata.processor_config(),
        "tokenizer.json": tokenizer_files.tokenizer_json(shape.vocab),
        "tokenizer_config.json": tokenizer_files.tokenizer_config_json(metadata.MAX_POSITION_EMBEDDINGS),
    }
    paths = []
    for name, doc in documents.items():
        path = out_dir / name
        # Indented where a person reads it; the 155k-entry vocabulary compact (json's fast path has no indent).
        indent = None if name == "tokenizer.json" else 2
        path.write_text(json.dumps(doc, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def split_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive runs of tensors of at most ``shard_bytes`` each (a larger tensor gets a shard of its own)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def _write_shards(out_dir: Path, specs: list[TensorSpec], shard_bytes: int, source: RandomSource,
                  report: WriteReport, log: Callable[[str], None], progress: Progress) -> list[Path]:
    shards = split_shards(specs, shard_bytes)
    weight_map, paths = {}, []
    progress.phase("writing shards", total=sum(s.nbytes for s in specs))
    for n, shard in enumerate(shards, start=1):
        path = out_dir / f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        started = time.perf_counter()
        with open_shard(path, [s.entry for s in shard]) as out:
            for spec in shard:
                out.write(spec.name, spec.chunks(source))
                weight_map[spec.name] = path.name
                progress.advance(spec.nbytes)
        seconds = time.perf_counter() - started
        report.write_seconds += seconds
        report.weight_bytes += out.data_bytes
        report.tensors += len(shard)
        log(f"  {path.name}: {len(shard)} tensors, {out.data_bytes / 1e9:.2f} GB, "
            f"{out.data_bytes / max(seconds, 1e-9) / 1e9:.2f} GB/s")
        paths.append(path)
    progress.finish()
    index = {"metadata": {"total_size": report.weight_bytes}, "weight_map": weight_map}
    index_path = out_dir / INDEX_NAME
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return paths + [index_path]


def _bias_locations(ckpt_dir: Path) -> dict[int, tuple[str, Path]]:
    """Layer index -> (tensor name, shard) of every router bias, from the index."""
    weight_map = json.loads((Path(ckpt_dir) / INDEX_NAME).read_text())["weight_map"]
    found = {}
    for name, file in weight_map.items():
        if name.startswith(f"{PREFIX}.layers.") and name.endswith(BIAS_SUFFIX):
            layer = int(name[len(f"{PREFIX}.layers.") : -len(BIAS_SUFFIX)])
            found[layer] = (name, Path(ckpt_dir) / file)
    return found


def read_router_biases(ckpt_dir: Path) -> dict[int, np.ndarray]:
    """The ``e_score_correction_bias`` of every MoE layer: ``{layer index: float32 [E]}``."""
    biases = {}
    for layer, (name, path) in sorted(_bias_locations(ckpt_dir).items()):
        header, start = read_header(path)
        begin, end = header[name]["data_offsets"]
        with open(path, "rb") as f:
            f.seek(start + begin)
            biases[layer] = np.frombuffer(f.read(end - begin), dtype="<f4").copy()
    return biases


def write_router_biases(ckpt_dir: Path, biases: Mapping[int, np.ndarray]) -> None:
    """Overwrite router biases in place in their shards (nothing else in the files changes).

    :param biases: ``{layer index: float32 array [E]}``; each must have the stored tensor's dtype and size.
    :raise KeyError: a layer with no router bias in the checkpoint.
    :raise ValueError: an array that is not float32 or not the stored length.
    """
    locations = _bias_locations(ckpt_dir)
    for layer, values in biases.items():
        if layer not in locations:
            raise KeyError(f"layer {layer} has no router bias in {ckpt_dir} (MoE layers: {sorted(locations)})")
        values = np.asarray(values)
        if values.dtype != np.float32 or values.ndim != 1:
            raise ValueError(f"layer {layer}: router bias must be a 1-D float32 array, got {values.dtype} {values.shape}")
        name, path = locations[layer]
        overwrite_tensor(path, name, "F32", values.astype("<f4").tobytes())
