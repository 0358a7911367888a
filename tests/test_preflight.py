import json
import os
import subprocess
import sys
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
    return preflight._model_dir(config.load(["-m", str(d)], {}))


def test_complete_checkpoint(tmp_path):
    c = check(model_dir(tmp_path))
    assert c.level == "ok" and "1 shard(s)" in c.message


def test_missing_config(tmp_path):
    c = check(tmp_path)
    assert c.level == "fail" and "no config.json" in c.message and "GLM53_MODEL_DIR" in c.message
    assert "huggingface-cli download turboderp/GLM-5.3-Flash-exl3 --revision 332ab457" in c.message


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


def test_download_with_the_hub_unreachable_stops_with_the_fetch_command(tmp_path):
    env = dict(os.environ, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2",
               HF_HOME=str(tmp_path / "hf"), CUDA_VISIBLE_DEVICES="")
    env = {k: v for k, v in env.items() if not k.startswith("GLM53_")}
    env.update(GLM53_MODEL_DOWNLOAD="1", GLM53_MODEL_DIR=str(tmp_path / "model"), GLM53_ENGINE="exl3")
    out = subprocess.run([sys.executable, "-m", "glm53", "serve"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert f"into {tmp_path / 'model'}" in out.stderr and "huggingface-cli download turboderp/GLM-5.3-Flash-exl3 --revision" in out.stderr
