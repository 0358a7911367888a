"""The host store's plan and loading, and the learned routing profile, on small hand-made checkpoints (CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from glm53.offload.host_store import ALIGN, HostStore
from glm53.offload.profile import merge_profile

PREFIX = "model.language_model.layers"
SHAPES = {"gate": (4, 2, 48), "up": (4, 2, 48), "down": (2, 4, 48)}  # int16 trellises: [in/16, out/16, 16K], K=3


def _write_shard(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, blobs, at = {}, [], 0
    for name, array in tensors.items():
        data = array.tobytes()
        dtype = {"int16": "I16", "float16": "F16", "int32": "I32"}[array.dtype.name]
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def _checkpoint(tmp_path: Path, layers=(3, 4), experts=3, seed=None, drop=None, dtype=np.int16, shapes=SHAPES) -> tuple[Path, dict]:
    rng = np.random.default_rng(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    tensors = {}
    for layer in layers:
        for e in range(experts):
            for proj, shape in shapes.items():
                name = f"{PREFIX}.{layer}.mlp.experts.{e}.{proj}_proj.trellis"
                if name != drop:
                    tensors[name] = rng.integers(-32768, 32767, size=shape, dtype=np.int64).astype(dtype)
                tensors[f"{PREFIX}.{layer}.mlp.experts.{e}.{proj}_proj.suh"] = np.ones(shape[0] * 16, dtype=np.float16)
    # two shards, the split falling inside a layer, plus an index
    names = list(tensors)
    half = len(names) // 2
    _write_shard(tmp_path / "a.safetensors", {n: tensors[n] for n in names[:half]})
    _write_shard(tmp_path / "b.safetensors", {n: tensors[n] for n in names[half:]})
    index = {"weight_map": {n: ("a" if i < half else "b") + ".safetensors" for i, n in enumerate(names)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path, tensors


def test_the_store_holds_every_expert_trellis_byte_for_byte_in_exact_size_arenas(tmp_path):
    ckpt, tensors = _checkpoint(tmp_path)
    store = HostStore.scan(ckpt)
    assert store.layer_keys == [f"{PREFIX}.3.mlp", f"{PREFIX}.4.mlp"]
    assert store.num_experts == 3
    nbytes = [int(np.prod(SHAPES[p])) * 2 for p in ("gate", "up", "down")]
    assert store.layout.nbytes == tuple(nbytes)
    assert store.layout.offsets == (0, nbytes[0], nbytes[0] + nbytes[1])  # 768 B each: already aligned
    assert all(o % ALIGN == 0 for o in store.layout.offsets)
    assert store.arena_bytes == store.trellis_bytes == 2 * 3 * sum(nbytes)
    store.load(threads=3)
    for row, layer in enumerate((3, 4)):
        assert store.arenas[row].numel() == 3 * store.layout.block_bytes
        for e in range(3):
            block = store.host_block(row, e).numpy()
            for i, proj in enumerate(("gate", "up", "down")):
                want = tensors[f"{PREFIX}.{layer}.mlp.experts.{e}.{proj}_proj.trellis"].tobytes()
                at = store.layout.offsets[i]
                assert block[at : at + len(want)].tobytes() == want, (layer, e, proj)
    assert store.trellis_view(f"{PREFIX}.3.mlp.experts.0.gate_proj.trellis") is None  # no CUDA aliases yet
    assert store.describe()["pinned"] is False


def test_unaligned_projections_are_padded_to_the_alignment(tmp_path):
    shapes = {"gate": (1, 1, 48), "up": (1, 1, 48), "down": (1, 1, 48)}  # 96 B each
    ckpt, tensors = _checkpoint(tmp_path, shapes=shapes, seed=1)
    store = HostStore.scan(ckpt)
    assert store.layout.offsets == (0, 256, 512) and store.layout.block_bytes == 768
    store.load()
    want = tensors[f"{PREFIX}.4.mlp.experts.2.down_proj.trellis"].tobytes()
    assert store.host_block(1, 2).numpy()[512 : 512 + 96].tobytes() == want


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"drop": f"{PREFIX}.4.mlp.experts.1.up_proj.trellis"}, "experts.1.up_proj.trellis is missing"),
        ({"dtype": np.int32}, "trellis dtype I32, expected I16"),
    ],
)
def test_an_incomplete_or_odd_checkpoint_is_refused_with_the_tensor_named(tmp_path, kwargs, message):
    ckpt, _ = _checkpoint(tmp_path, seed=2, **kwargs)
    with pytest.raises(ValueError, match=message):
        HostStore.scan(ckpt)


def test_a_checkpoint_without_routed_experts_is_refused(tmp_path):
    _write_shard(tmp_path / "x.safetensors", {"model.embed_tokens.weight": np.zeros((4, 4), dtype=np.float16)})
    with pytest.raises(ValueError, match="no routed expert trellises"):
        HostStore.scan(tmp_path)


def test_a_learned_profile_adds_this_runs_picks_to_what_earlier_runs_learned():
    keys = ["a.mlp", "b.mlp"]
    picks = np.array([[1, 0, 2], [0, 5, 0]])
    assert merge_profile(None, keys, picks) == {"a.mlp": [1.0, 0.0, 2.0], "b.mlp": [0.0, 5.0, 0.0]}
    previous = {"a.mlp": [10, 10, 10], "b.mlp": [1, 2], "c.mlp": [7, 7, 7]}  # b: another expert count, c: gone
    assert merge_profile(previous, keys, picks) == {"a.mlp": [11.0, 10.0, 12.0], "b.mlp": [0.0, 5.0, 0.0]}


def test_the_sign_scale_vectors_are_read_per_layer_expert_and_projection(tmp_path):
    path, tensors = _checkpoint(tmp_path, seed=3)
    rng = np.random.default_rng(4)
    dims = {p: (s[0] * 16, s[1] * 16) for p, s in SHAPES.items()}
    extra = {}
    for layer in (3, 4):
        for e in range(3):
            for proj, (n_in, n_out) in dims.items():
                for which, n in (("suh", n_in), ("svh", n_out)):
                    extra[f"{PREFIX}.{layer}.mlp.experts.{e}.{proj}_proj.{which}"] = rng.standard_normal(n).astype(np.float16)
    _write_shard(path / "sign-scale.safetensors", extra)  # read after a and b: its suh replace their placeholders
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({n: "sign-scale.safetensors" for n in extra})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    store = HostStore.scan(path)
    got = store.read_sign_scale(path)
    for row, layer in enumerate((3, 4)):
        for e in range(3):
            for proj in SHAPES:
                assert np.array_equal(got[proj][0][row, e], extra[f"{PREFIX}.{layer}.mlp.experts.{e}.{proj}_proj.suh"])
                assert np.array_equal(got[proj][1][row, e], extra[f"{PREFIX}.{layer}.mlp.experts.{e}.{proj}_proj.svh"])
    missing = {k: v for k, v in extra.items() if not k.endswith("experts.2.down_proj.svh") or f".{4}." not in k}
    _write_shard(path / "sign-scale.safetensors", missing)
    with pytest.raises(ValueError, match=r"layers\.4\.mlp\.experts\.2\.down_proj\.svh is missing"):
        store.read_sign_scale(path)
    wrong = dict(extra)
    wrong[f"{PREFIX}.3.mlp.experts.0.gate_proj.suh"] = np.zeros(5, np.float16)
    _write_shard(path / "sign-scale.safetensors", wrong)
    with pytest.raises(ValueError, match="expected F16 of 64 values"):
        store.read_sign_scale(path)


def test_reading_and_pinning_report_their_bytes(tmp_path):
    import torch

    from glm53.progress import Progress

    ckpt, _ = _checkpoint(tmp_path, layers=(3, 4, 5), seed=3)
    store = HostStore.scan(ckpt)
    seen = []

    class Recorder(Progress):
        def _changed(self, state):
            seen.append((state.name, state.done, state.total))

    progress = Recorder()
    store.load(threads=2, progress=progress.steps("reading shards"))
    reads = [s for s in seen if s[0] == "reading shards"]
    assert reads[-1] == ("reading shards", store.trellis_bytes, store.trellis_bytes)
    assert [d for _, d, _ in reads] == sorted(d for _, d, _ in reads)  # never backwards
    registered = []
    store.pin_and_map(torch.device("cpu"), lambda ptr, n: registered.append(n), lambda t, index: t, progress=progress.steps("pinning"))
    arena = store.arena_bytes // 3
    assert registered == [arena] * 3
    assert [s for s in seen if s[0] == "pinning"] == [("pinning", 0, 3 * arena)] + [("pinning", k * arena, 3 * arena) for k in (1, 2, 3)]
