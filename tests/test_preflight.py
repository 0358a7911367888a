import json
from pathlib import Path

from glm53 import config, preflight


def model_dir(tmp_path: Path, arch="Glm5NextForConditionalGeneration", shards=("a.safetensors",), write=("a.safetensors",), truncate=False) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {f"t{i}": s for i, s in enumerate(shards)}}))
    header = json.dumps({"t": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}).encode()
    for name in write:
        body = len(header).to_bytes(8, "little") + header + b"\0" * (4 if truncate else 8)
        (d / name).write_bytes(body)
    return d


def check(d: Path) -> preflight.Check:
    return preflight._model_dir(d)


def test_complete_checkpoint(tmp_path):
    c = check(model_dir(tmp_path))
    assert c.level == "ok" and "1 shard(s)" in c.message


def test_missing_config(tmp_path):
    c = check(tmp_path)
    assert c.level == "fail" and "no config.json" in c.message and "GLM53_MODEL_DIR" in c.message


def test_shard_named_in_the_index_is_absent(tmp_path):
    c = check(model_dir(tmp_path, shards=("a.safetensors", "b.safetensors")))
    assert c.level == "fail" and "lacks 1 shard" in c.message and "b.safetensors" in c.message


def test_short_shard(tmp_path):
    c = check(model_dir(tmp_path, truncate=True))
    assert c.level == "fail" and "shorter than its header says" in c.message


def test_unsupported_architecture(tmp_path):
    c = check(model_dir(tmp_path, arch="LlamaForCausalLM"))
    assert c.level == "fail" and "LlamaForCausalLM" in c.message and "GLM-5.3-Flash" in c.message


def test_exl3_without_a_gpu_stops_the_start(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    s = config.load(["--engine", "exl3", "-m", str(model_dir(tmp_path))], {})
    failed = {c.name: c.message for c in preflight.failures(preflight.run_checks(s))}
    assert "gpu" in failed and "--engine tiny" in failed["gpu"]


def test_auto_falls_back_to_the_demo_model_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    s = config.load(["-m", str(model_dir(tmp_path))], {})
    checks = preflight.run_checks(s)
    assert checks[0].message.startswith("tiny: no CUDA GPU") and not preflight.failures(checks)
