"""glm53 synth: the tiny checkpoint's files, tensors and determinism; the router API; the EXL3 decoder."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from glm53 import cli
from glm53.models.glm_special_tokens import SPECIAL_TOKENS
from glm53.models.safetensors_header import read_header
from glm53.progress import Progress
from glm53.tools.synth import exl3_reference, presets, router, tensors, writer
from glm53.tools.synth.random_pool import RandomSource

PROFILE = Path(__file__).resolve().parents[2] / "glm53" / "models" / "glm53-flash-routing-profile.json"
P = "model.language_model"
ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "I16": 2, "I32": 4}
SHARD_BYTES = 200 * 1000**2  # small shards, so the tiny checkpoint (~0.57 GB) spans several


class RecordedProgress(Progress):
    def __init__(self):
        super().__init__()
        self.states = []

    def _changed(self, state):
        self.states.append(state)


WRITE_PROGRESS = RecordedProgress()  # what writing the module's tiny checkpoint reported


def _write(out: Path, seed: int = 0, progress: Progress | None = None) -> writer.WriteReport:
    return writer.write_checkpoint(out, "tiny", seed=seed, profile=PROFILE, shard_bytes=SHARD_BYTES,
                                   stats_out=out.parent / f"{out.name}-stats.json", log=lambda line: None, progress=progress)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Iterator[Path]:
    out = tmp_path_factory.mktemp("synth") / "tiny"
    report = _write(out, progress=WRITE_PROGRESS)
    WRITE_PROGRESS.weight_bytes = report.weight_bytes
    yield out
    shutil.rmtree(out.parent)  # 0.6 GB; pytest would keep it for three sessions


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _headers(ckpt: Path) -> dict[str, tuple[Path, dict, int]]:
    """Tensor name -> (shard, header entry, absolute data offset) over every shard."""
    found = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        header, start = read_header(shard)
        for name, entry in header.items():
            found[name] = (shard, entry, start + entry["data_offsets"][0])
    return found


def _read(ckpt: Path, name: str, dtype: str) -> np.ndarray:
    shard, entry, offset = _headers(ckpt)[name]
    begin, end = entry["data_offsets"]
    with open(shard, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(end - begin), dtype=dtype).reshape(entry["shape"])


# --- what exllamav3 should find, derived from config.json alone ------------------------------------------

def _exl3(key: str, n_in: int, n_out: int, bits: int) -> dict:
    return {f"{key}.trellis": ("I16", [n_in // 16, n_out // 16, 16 * bits]), f"{key}.suh": ("F16", [n_in]),
            f"{key}.svh": ("F16", [n_out]), f"{key}.mul1": ("I32", [])}


def _expected_tensors(cfg: dict) -> dict[str, tuple[str, list[int]]]:
    t = cfg["text_config"]
    h, la = t["hidden_size"], t["linear_attn_config"]
    kda_width = la["num_heads"] * la["head_dim"]
    m = t["hc_mult"]
    want = {f"{P}.embed_tokens.weight": ("F16", [t["vocab_size"], h]), f"{P}.norm.weight": ("BF16", [h])}
    want |= _exl3("lm_head", h, t["vocab_size"], 6)
    for i in range(t["num_hidden_layers"]):
        key = f"{P}.layers.{i}"
        want[f"{key}.input_layernorm.weight"] = ("BF16", [h])
        want[f"{key}.post_attention_layernorm.weight"] = ("BF16", [h])
        for site in ("attn", "ffn"):
            want[f"{key}.hc_{site}_fn"] = ("F32", [(2 + m) * m, m * h])
            want[f"{key}.hc_{site}_base"] = ("F32", [(2 + m) * m])
            want[f"{key}.hc_{site}_scale"] = ("F32", [3])
        a = f"{key}.self_attn"
        if t["layer_types"][i] == "linear_attention":
            want |= _exl3(f"{a}.qkv_proj", h, 3 * kda_width, 4) | _exl3(f"{a}.o_proj", kda_width, h, 4)
            want |= {f"{a}.b_proj.weight": ("F16", [la["num_heads"], h]),
                     f"{a}.f_a_proj.weight": ("F16", [la["head_dim"], h]),
                     f"{a}.f_b_proj.weight": ("F16", [kda_width, la["head_dim"]]),
                     f"{a}.g_a_proj.weight": ("F16", [la["head_dim"], h]),
                     f"{a}.g_b_proj.weight": ("F16", [kda_width, la["head_dim"]]),
                     f"{a}.A_log": ("F32", [la["num_heads"]]), f"{a}.dt_bias": ("BF16", [kda_width]),
                     f"{a}.o_norm.weight": ("BF16", [la["head_dim"]])}
            want |= {f"{a}.{x}_conv1d.weight": ("BF16", [kda_width, 1, la["short_conv_kernel_size"]]) for x in "qkv"}
        else:
            heads, q_rank, kv_rank = t["num_attention_heads"], t["q_lora_rank"], t["kv_lora_rank"]
            nope, v, ih, idim = t["qk_nope_head_dim"], t["v_head_dim"], t["index_n_heads"], t["index_head_dim"]
            want |= _exl3(f"{a}.q_a_proj", h, q_rank, 4) | _exl3(f"{a}.q_b_proj", q_rank, heads * nope, 4)
            want |= _exl3(f"{a}.kv_a_proj_with_mqa", h, kv_rank, 4) | _exl3(f"{a}.o_proj", heads * v, h, 4)
            want |= _exl3(f"{a}.indexer.wq_b", q_rank, ih * idim, 4)
            want |= {f"{a}.q_a_layernorm.weight": ("BF16", [q_rank]),
                     f"{a}.kv_a_layernorm.weight": ("BF16", [kv_rank]),
                     f"{a}.kv_b_proj.weight": ("F16", [heads * (nope + v), kv_rank]),
                     f"{a}.indexer.wk.weight": ("F16", [idim, h]),
                     f"{a}.indexer.weights_proj.weight": ("F16", [ih, h]),
                     f"{a}.indexer.k_norm.weight": ("F16", [idim]), f"{a}.indexer.k_norm.bias": ("F16", [idim]),
                     f"{a}.indexer.index_kpool_compress_ape": ("BF16", [t["index_kpool"], idim]),
                     f"{a}.indexer.index_kpool_compress_gate": ("BF16", [idim, h])}
        mlp = f"{key}.mlp"
        if t["mlp_layer_types"][i] == "dense":
            inter = t["intermediate_size"]
            want |= _exl3(f"{mlp}.gate_proj", h, inter, 4) | _exl3(f"{mlp}.up_proj", h, inter, 4)
            want |= _exl3(f"{mlp}.down_proj", inter, h, 4)
            continue
        e_count, inter = t["n_routed_experts"], t["moe_intermediate_size"]
        want[f"{mlp}.gate.weight"] = ("F16", [e_count, h])
        want[f"{mlp}.gate.e_score_correction_bias"] = ("F32", [e_count])
        for e, bits in [(f"experts.{e}", 3) for e in range(e_count)] + [("shared_experts", 4)]:
            want |= _exl3(f"{mlp}.{e}.gate_proj", h, inter, bits) | _exl3(f"{mlp}.{e}.up_proj", h, inter, bits)
            want |= _exl3(f"{mlp}.{e}.down_proj", inter, h, bits)
    return want


# --- the checkpoint ----------------------------------------------------------------------------------------

def test_every_file_exists_and_parses(tiny):
    names = {p.name for p in tiny.iterdir()}
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    assert len(shards) >= 3
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert names == set(shards) | {"model.safetensors.index.json", writer.ROUTING_PROFILE_FILE, *writer.JSON_FILES}
    for name in (*writer.JSON_FILES, writer.ROUTING_PROFILE_FILE):
        json.loads((tiny / name).read_text())


def test_config_has_the_real_schedule_and_what_exllamav3_reads(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    t = cfg["text_config"]
    assert cfg["architectures"] == ["Glm5NextForConditionalGeneration"]
    assert cfg["eos_token_id"] == [154820, 154827, 154829] and cfg["pad_token_id"] == 154820
    assert (cfg["image_start_token_id"], cfg["image_end_token_id"]) == (154830, 154831)
    assert cfg["tie_word_embeddings"] is False and cfg["quantization_config"]["codebook"] == "mul1"
    n = t["num_hidden_layers"]
    assert n == 8 and t["vocab_size"] == 154880
    assert t["layer_types"] == ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    assert t["mlp_layer_types"] == ["dense"] * 3 + ["sparse"] * 5
    assert (t["qk_rope_head_dim"], t["index_kpool_compress"], t["mhc"], t["norm_topk_prob"]) == (0, True, True, True)
    assert (t["scoring_func"], t["topk_method"], t["hidden_act"]) == ("sigmoid", "noaux_tc", "silu")
    assert (t["n_group"], t["topk_group"], t["routed_scaling_factor"], t["swiglu_limit"]) == (1, 1, 2.5, 10.0)
    assert t["num_nextn_predict_layers"] == 0 and len(t["indexer_types"]) == n
    vision_keys = {"depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size",
                   "patch_size", "spatial_merge_size", "temporal_patch_size", "model_type", "attention_bias",
                   "image_size", "rms_norm_eps"}  # read_glm4v_vision_config's required keys
    assert vision_keys <= cfg["vision_config"].keys() and cfg["vision_config"]["model_type"] == "glm5_next_vision"
    image = json.loads((tiny / "processor_config.json").read_text())["image_processor"]
    assert {"patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std", "min_image_tokens",
            "max_image_tokens"} <= image.keys() and image["image_processor_type"] == "Glm5NextImageProcessor"
    synth = cfg["glm53_synth"]
    assert (synth["preset"], synth["seed"], synth["moe_layers"]) == ("tiny", 0, 5)
    assert synth["routing_profile"]["layer_map"] == {"3": 3, "4": 13, "5": 24, "6": 34, "7": 44}
    assert synth["routing_profile"]["sha256"] == hashlib.sha256(PROFILE.read_bytes()).hexdigest()
    assert json.loads((tiny / "generation_config.json").read_text())["eos_token_id"] == [154820, 154827, 154829]


def test_every_tensor_has_the_expected_name_dtype_and_shape(tiny):
    want = _expected_tensors(json.loads((tiny / "config.json").read_text()))
    got = {name: (entry["dtype"], entry["shape"]) for name, (_, entry, _) in _headers(tiny).items()}
    assert got.keys() == want.keys()
    assert {name: got[name] for name in want if got[name] != want[name]} == {}


def test_headers_are_contiguous_aligned_and_sized(tiny):
    for shard in tiny.glob("*.safetensors"):
        header, start = read_header(shard)
        assert start % 8 == 0
        end = 0
        for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, stop = entry["data_offsets"]
            assert begin == end, name
            assert stop - begin == math.prod(entry["shape"]) * ITEMSIZE[entry["dtype"]], name
            assert (start + begin) % ITEMSIZE[entry["dtype"]] == 0, name
            end = stop
        assert start + end == shard.stat().st_size


def test_index_maps_every_tensor_to_its_shard(tiny):
    index = json.loads((tiny / "model.safetensors.index.json").read_text())
    headers = _headers(tiny)
    assert index["weight_map"] == {name: shard.name for name, (shard, _, _) in headers.items()}
    sizes = [e["data_offsets"][1] - e["data_offsets"][0] for _, e, _ in headers.values()]
    assert index["metadata"]["total_size"] == sum(sizes)


def test_exl3_markers_and_scales(tiny):
    headers = _headers(tiny)
    markers = [n for n in headers if n.endswith(".mul1")]
    assert len(markers) == sum(n.endswith(".trellis") for n in headers)
    for name in markers:
        assert int.from_bytes(_read(tiny, name, "<i4").tobytes(), "little") == 0x83DCD12D
    expert = f"{P}.layers.4.mlp.experts.7.down_proj"
    assert set(np.abs(_read(tiny, f"{expert}.suh", "<f2"))) == {np.float16(1.0)}
    assert set(np.abs(_read(tiny, f"{expert}.svh", "<f2"))) == {np.float16(0.02)}
    qkv = f"{P}.layers.0.self_attn.qkv_proj"
    assert set(np.abs(_read(tiny, f"{qkv}.svh", "<f2"))) == {np.float16(1 / math.sqrt(1024))}
    signs = _read(tiny, f"{qkv}.suh", "<f2")
    assert 0.4 < (signs > 0).mean() < 0.6


def test_same_seed_gives_identical_files_and_another_seed_other_bits(tiny, tmp_path, capsys):
    again = tmp_path / "again"
    _write(again)
    for path in tiny.iterdir():
        assert _sha256(path) == _sha256(again / path.name), path.name
    assert _sha256(tiny.parent / "tiny-stats.json") == _sha256(tmp_path / "again-stats.json")
    shutil.rmtree(again)

    # Another seed through the command line, over a stale checkpoint: --force replaces it and keeps other files.
    other = tmp_path / "other"
    other.mkdir()
    (other / "model-00009-of-00009.safetensors").write_bytes(b"stale")
    (other / "notes.txt").write_text("kept")
    assert cli.main(["synth", "--preset", "tiny", "--out", str(other), "--seed", "1", "--profile", str(PROFILE)]) == 1
    assert "not empty" in capsys.readouterr().err
    assert cli.main(["synth", "--preset", "tiny", "--out", str(other), "--seed", "1", "--profile", str(PROFILE),
                     "--force"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    print(printed)  # shows the write rate with pytest -s; its value depends on the machine
    assert "writing shards" not in captured.err  # no progress bar when the output is not a terminal
    assert re.search(r"needs [\d.]+ GB", printed) and re.search(r"\([\d.]+ GB/s;", printed)
    assert not (other / "model-00009-of-00009.safetensors").exists() and (other / "notes.txt").exists()
    trellis = [n for n in _headers(tiny) if n.endswith(".trellis")]
    theirs = _headers(other)
    for name in trellis[::25]:
        assert _read(tiny, name, "<i2").tobytes() != _read(other, name, "<i2").tobytes()
    assert theirs.keys() == _headers(tiny).keys()
    shutil.rmtree(other)


def test_writing_reports_the_shards_bytes(tiny):
    states = WRITE_PROGRESS.states
    assert {s.name for s in states} == {"writing shards"} and len(states) > 100  # one report per tensor
    assert [s.done for s in states] == sorted(s.done for s in states)
    assert states[-1].done == states[-1].total == WRITE_PROGRESS.weight_bytes


def test_refuses_to_overwrite_and_leaves_the_checkpoint_alone(tiny):
    before = {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()}
    with pytest.raises(FileExistsError):
        writer.write_checkpoint(tiny, "tiny", profile=PROFILE, log=lambda line: None)
    assert {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()} == before


def test_refuses_without_disk_space(tmp_path, monkeypatch):
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda path: SimpleNamespace(free=10**6))
    with pytest.raises(OSError, match="not enough disk space"):
        writer.write_checkpoint(tmp_path / "full", "tiny", profile=PROFILE, log=lambda line: None)
    assert not (tmp_path / "full").exists()


def test_every_expert_has_its_own_trellis(tiny):
    digests = {}
    for layer in range(3, 8):
        for e in range(16):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"{P}.layers.{layer}.mlp.experts.{e}.{proj}.trellis"
                digests[name] = hashlib.sha256(_read(tiny, name, "<i2").tobytes()).hexdigest()
    assert len(set(digests.values())) == len(digests) == 5 * 16 * 3


def test_router_biases_round_trip_in_place(tiny):
    biases = writer.read_router_biases(tiny)
    assert sorted(biases) == [3, 4, 5, 6, 7]
    assert all(b.dtype == np.float32 and b.shape == (16,) and abs(b.mean()) < 1e-6 for b in biases.values())
    name = f"{P}.layers.5.mlp.gate.e_score_correction_bias"
    shard, entry, offset = _headers(tiny)[name]
    before = shard.read_bytes()
    size = entry["data_offsets"][1] - entry["data_offsets"][0]
    new = np.linspace(-0.1, 0.1, 16, dtype=np.float32)
    writer.write_router_biases(tiny, {5: new})
    after = shard.read_bytes()
    assert after[:offset] == before[:offset] and after[offset + size :] == before[offset + size :]
    assert np.array_equal(writer.read_router_biases(tiny)[5], new)
    with pytest.raises(ValueError):
        writer.write_router_biases(tiny, {5: new.astype(np.float64)})
    with pytest.raises(ValueError):
        writer.write_router_biases(tiny, {5: new[:8]})
    with pytest.raises(KeyError):
        writer.write_router_biases(tiny, {1: new})
    writer.write_router_biases(tiny, {5: biases[5]})
    assert shard.read_bytes() == before


def test_stats_file_lists_the_targets_of_the_synthetic_layers(tiny):
    stats = json.loads((tiny.parent / "tiny-stats.json").read_text())
    profile = router.load_profile(PROFILE)
    assert list(stats) == [f"{P}.layers.{i}.mlp" for i in range(3, 8)]
    for counts, real in zip(stats.values(), [3, 13, 24, 34, 44]):
        assert len(counts) == 16
        expected = router.target_shares(profile, real, 16)
        assert np.allclose(np.array(counts) / sum(counts), expected, atol=1e-6)


def test_tokenizer_has_glm_ids_and_round_trips(tiny):
    from tokenizers import Tokenizer  # the dev extra's: only this test needs it

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert tok.get_vocab_size() == 154880
    text = "[gMASK]<sop><|user|>hi<|assistant|><think>"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == [154822, 154824, 154827, ord("h"), ord("i"), 154828, 154841]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("héllo", add_special_tokens=False).ids == list("héllo".encode())
    assert tok.decode([300, 154879]) == " w300 w154879"
    assert all(tok.token_to_id(t.text) == t.glm_id for t in SPECIAL_TOKENS)
    config = json.loads((tiny / "tokenizer_config.json").read_text())
    template = resources.files("glm53.models").joinpath("glm5_chat_template.jinja").read_text(encoding="utf-8")
    assert config["chat_template"] == template
    assert (config["eos_token"], config["pad_token"], config["bos_token"]) == ("<|endoftext|>", "<|endoftext|>", None)
    assert {int(i): d["content"] for i, d in config["added_tokens_decoder"].items()} == {
        t.glm_id: t.text for t in SPECIAL_TOKENS}


def test_written_expert_decodes_to_finite_weights_of_the_intended_rms(tiny):
    key = f"{P}.layers.6.mlp.experts.11.up_proj"
    trellis = _read(tiny, f"{key}.trellis", "<i2")
    states = exl3_reference.decode_states(trellis).astype(np.uint32)
    k = trellis.shape[-1] // 16
    # A trellis: each state shares its top 16-K bits with the previous state's low bits, around the ring.
    assert np.array_equal(states >> k, np.roll(states, 1, axis=-1) & ((1 << (16 - k)) - 1))
    w_hat = exl3_reference.decode_tiles(trellis)
    assert w_hat.shape == (1024, 512) and np.isfinite(w_hat).all()
    assert abs(np.sqrt((w_hat**2).mean()) - 1.0) < 0.02
    w = exl3_reference.dense_weight(trellis, _read(tiny, f"{key}.suh", "<f2"), _read(tiny, f"{key}.svh", "<f2"))
    assert abs(np.sqrt((w**2).mean()) / 0.02 - 1.0) < 0.02


def test_mul1_codebook_has_unit_rms_and_the_tile_order_is_a_permutation():
    values = exl3_reference.mul1_values(np.arange(65536, dtype=np.uint16))
    assert abs(np.sqrt((values**2).mean()) - 1.0) < 0.01 and abs(values.mean()) < 0.01
    assert sorted(exl3_reference.tc_perm()) == list(range(256))


# --- presets, random pool, shards ----------------------------------------------------------------------------

def test_presets_keep_the_kernel_constraints_and_sizes():
    tiny = presets.resolve("tiny")
    assert tiny.layers >= 8 and sum(tiny.is_mla(i) for i in range(tiny.layers)) == 2 and tiny.moe_layers >= 4
    for s in (tiny, presets.resolve("scaled"), presets.resolve("full")):
        assert (s.kv_lora_rank, s.qk_nope_head_dim, s.v_head_dim, s.kda_head_dim, s.vocab) == (512, 256, 256, 128, 154880)
        widths = (s.hidden, s.q_lora_rank, s.dense_intermediate, s.moe_intermediate, s.mla_heads * s.v_head_dim)
        assert all(w % 128 == 0 for w in widths)
    tiny_bytes = sum(t.nbytes for t in tensors.plan(tiny, presets.SCALES))
    scaled_bytes = sum(t.nbytes for t in tensors.plan(presets.resolve("scaled"), presets.SCALES))
    assert tiny_bytes < 0.7e9 and 35e9 < scaled_bytes < 38e9
    assert presets.resolve("scaled", moe_layers=1).layers == 4 and presets.resolve("full").layers == 45
    with pytest.raises(ValueError):
        presets.resolve("huge")


def test_random_pool_is_deterministic_and_never_repeats_a_chunk():
    a, b = RandomSource(3), RandomSource(3)
    nbytes = 3 * 64 * 2**20 + 12345  # several times the pool
    first = [hashlib.sha256(c).hexdigest() for c in a.bits("t", nbytes)]
    assert first == [hashlib.sha256(c).hexdigest() for c in b.bits("t", nbytes)]
    assert len(set(first)) == len(first)
    assert next(a.bits("t", 64)).tobytes() != next(a.bits("u", 64)).tobytes()
    values = np.concatenate([np.frombuffer(c, dtype="<f2") for c in a.normal("n", 1 << 20, 0.5, "F16")])
    assert abs(values.astype(np.float32).std() - 0.5) < 0.01


def test_split_shards_bounds_each_shard():
    specs = [tensors.TensorSpec(f"t{i}", "F16", (n,), tensors.Constant(0.0)) for i, n in enumerate([10, 20, 90, 5, 5])]
    shards = writer.split_shards(specs, shard_bytes=60)
    assert [[s.name for s in shard] for shard in shards] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


# --- router API ------------------------------------------------------------------------------------------------

def test_top_share():
    assert router.top_share([1, 2, 3, 4], k=2) == pytest.approx(0.7)
    assert router.top_share(np.ones(288)) == pytest.approx(32 / 288)


def test_layer_map():
    assert router.layer_map(12) == [3, 7, 10, 14, 18, 22, 25, 29, 33, 37, 40, 44]
    assert router.layer_map(42) == list(range(3, 45))
    assert router.layer_map(1) == [3] and router.layer_map(2) == [3, 44]
    assert router.layer_map(5) == [3, 13, 24, 34, 44]


def test_target_shares_subsample_the_profile():
    profile = router.load_profile(PROFILE)
    counts = np.array(profile[f"{P}.layers.7.mlp"])
    full = router.target_shares(profile, 7, 288)
    assert np.allclose(full, (counts + 0.5) / (counts + 0.5).sum())
    small = router.target_shares(profile, 7, 16)
    picked = counts[::18] + 0.5
    assert np.allclose(small, picked / picked.sum())
    with pytest.raises(ValueError):
        router.target_shares(profile, 7, 300)
    with pytest.raises(ValueError, match="no entry"):
        router.target_shares(profile, 2, 16)


def test_bias_fit_reproduces_a_skewed_layer():
    profile = router.load_profile(PROFILE)
    target = router.target_shares(profile, 27, 288)  # top-32 share 0.50, the most skewed layer
    scores = router.sample_scores(np.random.default_rng(0), router.FIT_TOKENS, 288, 1.0)
    bias = router.fit_bias(target, 8, scores)
    counts = router.route_counts(router.sample_scores(np.random.default_rng(1), 65536, 288, 1.0), bias, 8)
    shares = counts / counts.sum()
    assert abs(router.top_share(counts) - router.top_share(target)) < 0.01
    assert 0.5 * np.abs(shares - target).sum() < 0.02  # total-variation distance; sampling noise alone ~0.01


def test_calibrate_bias_moves_a_mismatched_router_toward_the_target():
    # The simulated device adds a fixed per-expert logit offset the fit did not model (as a mean direction in
    # the hidden states would), so routing with the fitted bias misses the target until calibrated.
    profile = router.load_profile(PROFILE)
    target = router.target_shares(profile, 18, 288)
    bias = router.fit_bias(target, 8, router.sample_scores(np.random.default_rng(0), router.FIT_TOKENS, 288, 1.0))
    offset = np.random.default_rng(7).normal(0.0, 0.5, 288).astype(np.float32)
    rng = np.random.default_rng(1)

    def measured(b: np.ndarray) -> np.ndarray:
        z = rng.standard_normal((16384, 288), dtype=np.float32) + offset
        return router.route_counts(1.0 / (1.0 + np.exp(-z)), b, 8)

    def distance(counts: np.ndarray) -> float:
        return 0.5 * np.abs(counts / counts.sum() - target).sum()

    start = distance(measured(bias))
    for _ in range(8):
        bias = router.calibrate_bias(bias, measured(bias), target, step=0.02)
    assert start > 0.2 and distance(measured(bias)) < 0.35 * start
    assert abs(bias.mean()) < 1e-6 and bias.dtype == np.float32
