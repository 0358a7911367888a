import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from glm53 import cli, config, preflight


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


def test_download_with_the_hub_unreachable_stops_with_the_fetch_command(tmp_path, monkeypatch, capsys):
    """``glm53 serve`` in this process, its real hub client pointed at a closed port: the client's backoff between
    retries (1 + 2 + 4 + 8 + 8 s) is recorded instead of slept; the rest runs as it does for a user."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _http

    sleeps: list[float] = []
    monkeypatch.setattr(_http, "time", SimpleNamespace(sleep=sleeps.append))  # the one use of time in that module
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    for name in [k for k in os.environ if k.startswith("GLM53_")] + ["HF_TOKEN"]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for name, value in {"GLM53_MODEL_DOWNLOAD": "1", "GLM53_MODEL_DIR": str(tmp_path / "model"), "GLM53_ENGINE": "exl3"}.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["serve"]) == 1
    err = capsys.readouterr().err
    assert f"into {tmp_path / 'model'}" in err and "huggingface-cli download turboderp/GLM-5.3-Flash-exl3 --revision" in err
    assert "ConnectError" in err and sleeps, "the hub client did not try the closed port"


# ----- host figures and the checks built on them, from synthetic /proc and /sys files

from glm53 import host
from glm53.models import checkpoint
from glm53.tools.synth.safetensors_file import Entry, open_shard

GiB = 2**30
CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c\n\nprocessor\t: 1\nflags\t\t: fpu\n"


def fake_host(tmp_path: Path, avail_kb: int, cgroup_lines: str = "0::/\n", cpuinfo: str = CPUINFO) -> host.HostPaths:
    (tmp_path / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {avail_kb} kB\nHugePages_Total:       0\n")
    (tmp_path / "cgroup").write_text(cgroup_lines)
    (tmp_path / "cpuinfo").write_text(cpuinfo)
    (tmp_path / "sys").mkdir(exist_ok=True)
    return host.HostPaths(meminfo=tmp_path / "meminfo", cpuinfo=tmp_path / "cpuinfo", self_cgroup=tmp_path / "cgroup",
                          cgroup_root=tmp_path / "sys", shm=tmp_path)


def expert_checkpoint(tmp_path: Path) -> Path:
    """A checkpoint with 48 bytes of routed experts (16 of them suh/svh), plus a shared expert and a router."""
    d = model_dir(tmp_path, write=())
    entries = [Entry("model.layers.3.mlp.experts.0.gate_proj.trellis", "I16", (16,)),
               Entry("model.layers.3.mlp.experts.17.down_proj.suh", "F16", (8,)),
               Entry("model.layers.3.mlp.shared_experts.gate_proj.trellis", "I16", (64,)),
               Entry("model.layers.3.mlp.gate.weight", "F16", (4,))]
    with open_shard(d / "a.safetensors", entries) as shard:
        for e in entries:
            shard.write(e.name, [b"\0" * e.nbytes])
    return d


def test_meminfo_and_cpu_flags_are_read_from_the_given_files(tmp_path):
    paths = fake_host(tmp_path, 1234)
    assert host.meminfo(paths.meminfo)["MemAvailable"] == 1234 * 1024 and host.meminfo(paths.meminfo)["HugePages_Total"] == 0
    assert host.cpu_flags(paths.cpuinfo) == {"fpu", "sse2", "avx", "avx2", "fma", "f16c"}
    assert host.meminfo(tmp_path / "absent") == {} and host.cpu_flags(tmp_path / "absent") is None


def test_cgroup_v2_limit_is_the_lowest_along_the_path(tmp_path):
    paths = fake_host(tmp_path, 1, "0::/system.slice/glm53.service\n")
    svc = paths.cgroup_root / "system.slice" / "glm53.service"
    svc.mkdir(parents=True)
    (svc / "memory.max").write_text("max\n")
    (svc / "memory.current").write_text(f"{GiB}\n")
    (paths.cgroup_root / "system.slice" / "memory.max").write_text(f"{8 * GiB}\n")
    assert host.cgroup_memory(paths) == host.CgroupMemory(8 * GiB, GiB)
    (svc / "memory.max").write_text(f"{4 * GiB}\n")
    assert host.cgroup_memory(paths).limit == 4 * GiB


def test_cgroup_v1_limit_and_its_unlimited_value(tmp_path):
    paths = fake_host(tmp_path, 1, "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n")
    mem = paths.cgroup_root / "memory" / "docker" / "abc"
    mem.mkdir(parents=True)
    (mem / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    (mem / "memory.usage_in_bytes").write_text("1000\n")
    assert host.cgroup_memory(paths) == host.CgroupMemory(2 * GiB, 1000)
    (mem / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert host.cgroup_memory(paths) is None


def test_expert_bytes_come_from_the_headers(tmp_path):
    assert checkpoint.expert_bytes(expert_checkpoint(tmp_path)) == checkpoint.ExpertBytes(routed=48, sign_scale=16, moe_layers=1)


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_host_ram_need_per_mode_against_available_and_the_cgroup(tmp_path, mode):
    d = expert_checkpoint(tmp_path)
    settings = config.load(["-m", str(d), "--mode", mode, "--ct-threads", "4"], {})
    experts = checkpoint.expert_bytes(d)
    need = preflight.ram_needed(experts, settings)
    expected = int(1.02 * 48) + 6 * GiB + ((16 + 4 * 64 * 2**20) if mode == "fast" else 0)
    assert need == expected
    enough = fake_host(tmp_path, (need + GiB) // 1024)
    c = preflight._host_ram(experts, settings, enough)
    assert c.level == "ok" and f"{mode} mode needs" in c.message
    short = fake_host(tmp_path, (need - GiB) // 1024)
    c = preflight._host_ram(experts, settings, short)
    assert c.level == "fail" and "raise the memory limit" in c.message and ("GLM53_MODE=exact" in c.message) == (mode == "fast")
    # plenty available, but the cgroup's limit minus its use is short
    capped = fake_host(tmp_path, (need + 10 * GiB) // 1024, "0::/app\n")
    (capped.cgroup_root / "app").mkdir()
    (capped.cgroup_root / "app" / "memory.max").write_text(f"{need + GiB}\n")
    (capped.cgroup_root / "app" / "memory.current").write_text(f"{2 * GiB}\n")
    c = preflight._host_ram(experts, settings, capped)
    assert c.level == "fail" and "cgroup limit" in c.message


def test_short_host_ram_warns_with_the_share_a_ram_tier_holds_and_fails_below_one_layer(tmp_path):
    d = expert_checkpoint(tmp_path)
    experts = checkpoint.ExpertBytes(routed=100 * 10**9, sign_scale=0, moe_layers=40)  # 102 GB padded, 2.5 GB a layer
    plenty = fake_host(tmp_path, 200 * GiB // 1024)
    settings = config.load(["-m", str(d), "--mode", "exact"], {"GLM53_HOST_RAM_GB": "51"})
    c = preflight._host_ram(experts, settings, plenty)
    assert c.level == "warn" and "a RAM tier of 47.5 GiB (GLM53_HOST_RAM_GB=51) holds 50% of the routed experts" in c.message
    assert "read from the checkpoint's files on a miss" in c.message
    settings = config.load(["-m", str(d), "--mode", "exact"], {"GLM53_HOST_RAM_GB": "102"})
    assert preflight._host_ram(experts, settings, plenty).level == "ok"  # a budget that holds the store changes nothing
    settings = config.load(["-m", str(d), "--mode", "exact"], {})
    c = preflight._host_ram(experts, settings, fake_host(tmp_path, (6 * GiB + 51 * 10**9) // 1024))  # room for half
    assert c.level == "warn" and "a RAM tier of 47.5 GiB (what the process leaves) holds 50% of the" in c.message
    settings = config.load(["-m", str(d), "--mode", "exact"], {"GLM53_HOST_RAM_GB": "2"})
    c = preflight._host_ram(experts, settings, plenty)
    assert c.level == "fail" and "does not hold one MoE layer's experts (2.33 GiB)" in c.message


def test_fast_mode_needs_avx2_fma_f16c(tmp_path):
    assert preflight._cpu_features(fake_host(tmp_path, 1)).level == "ok"
    c = preflight._cpu_features(fake_host(tmp_path, 1, cpuinfo="flags\t: fpu avx2 fma\n"))
    assert c.level == "fail" and "lacks F16C" in c.message and "GLM53_MODE=exact" in c.message


def test_small_dev_shm_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(host, "shm_bytes", lambda path: 64 * 2**20)
    c = preflight._shm(fake_host(tmp_path, 1))
    assert c.level == "warn" and "64 MiB" in c.message and "--shm-size=1g" in c.message


def test_finite_memlock_is_a_warning_that_says_what_fails(monkeypatch, tmp_path):
    monkeypatch.setattr(preflight.resource, "getrlimit", lambda which: (8 * 2**20, 8 * 2**20))
    c = preflight._memlock(checkpoint.ExpertBytes(100 * GiB, 0))
    assert c.level == "warn" and "8 MiB" in c.message and "102.0 GiB host expert store" in c.message and "zero-copy" in c.message


def nvidia_smi(stdout: str, returncode: int = 0):
    return lambda cmd, **kw: subprocess.CompletedProcess(cmd, returncode, stdout, "")


def test_free_vram_from_nvidia_smi(monkeypatch):
    monkeypatch.setattr(preflight, "cuda_gpu_visible", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    out = "0, GPU-aaa, NVIDIA H200, 143771, 143000, 580.159.04, 9.0, 5, 16\n1, GPU-bbb, NVIDIA RTX 3090, 24576, 24000, 550.54.15, 8.6, [N/A], [N/A]\n"
    gpus = host.query_gpus(run=nvidia_smi(out))
    assert host.selected_gpu(gpus, "GPU-aaa").name == "NVIDIA H200"
    settings = config.load(["--vram-limit-gb", "20"], {})
    c = preflight._gpu(settings, lambda: gpus)
    assert c.level == "ok" and c.message.startswith("GPU 1 (NVIDIA RTX 3090, compute capability 8.6, driver 550.54.15): 23.4 GiB free of 24.0 GiB")
    c = preflight._gpu(config.load(["--vram-limit-gb", "30"], {}), lambda: gpus)
    assert c.level == "fail" and "GLM53_VRAM_LIMIT_GB" in c.message
    busy = [host.Gpu(1, "GPU-bbb", "NVIDIA RTX 3090", 24 * GiB, 10 * GiB, "550.54.15", "8.6")]
    c = preflight._gpu(config.load([], {}), lambda: busy)
    assert c.level == "warn" and "other processes hold 14.0 GiB" in c.message


def test_missing_nvidia_smi_is_a_warning_not_a_crash(monkeypatch):
    monkeypatch.setattr(preflight, "cuda_gpu_visible", lambda: True)

    def absent(cmd, **kw):
        raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")

    c = preflight._gpu(config.load([], {}), lambda: host.query_gpus(run=absent))
    assert c.level == "warn" and "nvidia-smi" in c.message
    with pytest.raises(OSError, match="nvidia-smi failed"):
        host.query_gpus(run=nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate with the driver", 9))


def test_exl3_preflight_puts_it_together(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "cuda_gpu_visible", lambda: True)
    monkeypatch.setattr(preflight, "resolve_engine", lambda s: ("exl3", "test"))
    d = expert_checkpoint(tmp_path)
    gpus = [host.Gpu(0, "GPU-a", "NVIDIA RTX 3090", 24 * GiB, 24 * GiB, "550.54.15", "8.6")]
    checks = preflight.run_checks(config.load(["-m", str(d)], {}), fake_host(tmp_path, 64 * GiB // 1024), lambda: gpus)
    by_name = {c.name: c for c in checks}
    assert {"gpu", "model", "host_ram", "memlock", "shm", "cpu"} <= set(by_name)
    assert by_name["host_ram"].level == "ok" and by_name["cpu"].level == "ok"
    exact = preflight.run_checks(config.load(["-m", str(d), "--mode", "exact"], {}), fake_host(tmp_path, 1), lambda: gpus)
    assert "cpu" not in {c.name for c in exact} and "host_ram" in {c.name for c in preflight.failures(exact)}


def gpu_with_driver(driver: str) -> list[host.Gpu]:
    return [host.Gpu(0, "GPU-a", "NVIDIA RTX 4090", 24 * GiB, 24 * GiB, driver, "8.9")]


@pytest.mark.parametrize("driver, level, says", [
    ("550.54.15", "fail", "cannot run CUDA 13 programs (the oldest that can is the 580 series)"),
    ("575.64.05", "fail", "install the 595 series or newer"),
    ("580.159.04", "warn", "only through minor-version compatibility"),
    ("590.48.01", "warn", "cudaErrorCallRequiresNewerDriver"),
    ("595.45.04", "ok", "supports CUDA 13.2 fully"),
    ("610.43.03", "ok", "supports CUDA 13.2 fully"),
])
def test_driver_branch_says_what_cuda_13_2_can_do(monkeypatch, driver, level, says):
    monkeypatch.setattr(preflight, "cuda_gpu_visible", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    c = preflight._driver(lambda: gpu_with_driver(driver))
    assert (c.name, c.level) == ("driver", level) and says in c.message and f"NVIDIA driver {driver}" in c.message


def test_compatibility_driver_names_what_works_and_what_does_not(monkeypatch):
    monkeypatch.setattr(preflight, "cuda_gpu_visible", lambda: True)
    c = preflight._driver(lambda: gpu_with_driver("580.159.04"))
    assert "Works: machine code built for this GPU" in c.message
    assert "Does not: a GPU the builds have no machine code for" in c.message
    assert c.message.endswith("The 595 series or newer supports CUDA 13.2 fully")


def test_driver_check_is_left_out_without_a_gpu_or_nvidia_smi(monkeypatch):
    monkeypatch.setattr(preflight, "cuda_gpu_visible", lambda: False)
    assert preflight._driver(lambda: gpu_with_driver("580.159.04")) is None
    monkeypatch.setattr(preflight, "cuda_gpu_visible", lambda: True)

    def absent():
        raise OSError("nvidia-smi is missing")

    assert preflight._driver(absent) is None
    c = preflight._driver(lambda: gpu_with_driver("N/A"))
    assert c.level == "warn" and "'N/A'" in c.message


def test_driver_of_the_selected_gpu_and_one_nvidia_smi_run(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "cuda_gpu_visible", lambda: True)
    monkeypatch.setattr(preflight, "resolve_engine", lambda s: ("exl3", "test"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-b")
    runs = []

    def query():
        runs.append(1)
        return [host.Gpu(0, "GPU-a", "NVIDIA H200", 141 * GiB, 141 * GiB, "595.71.05", "9.0"),
                host.Gpu(1, "GPU-b", "NVIDIA RTX 3090", 24 * GiB, 24 * GiB, "580.159.04", "8.6")]

    checks = preflight.run_checks(config.load(["-m", str(expert_checkpoint(tmp_path))], {}), fake_host(tmp_path, 64 * GiB // 1024), query)
    driver = {c.name: c for c in checks}["driver"]
    assert driver.level == "warn" and "580.159.04" in driver.message and len(runs) == 1


def test_driver_floors_match_the_nixos_side():
    # nix/lib/driver.nix gives the NixOS module and the appliance the same two branches
    text = (Path(__file__).resolve().parents[1] / "nix" / "lib" / "driver.nix").read_text()
    assert f'minimum = "{preflight.DRIVER_MINIMUM}";' in text and f'full = "{preflight.DRIVER_FULL}";' in text


def test_fast_mode_warns_where_the_cost_model_gives_the_cpu_tier_no_share(tmp_path):
    """Three CPU-tier threads with AVX2 against a PCIe 5 link (a miss read in 0.19 ms): the tier's jobs cost more than
    the link saves, so fast mode is projected to serve as exact mode, and says so; 23 AVX-512 VBMI threads on a PCIe 4
    link take a share."""
    flags = "flags\t: fpu avx2 fma f16c avx512f avx512bw avx512vl avx512vbmi avx512_vnni\n"
    few = config.load(["--mode", "fast", "--ct-threads", "3"], {})
    h200 = host.Gpu(0, "GPU-a", "NVIDIA H200", 141 * GiB, 141 * GiB, "580.159.04", "9.0", pcie_gen=5, pcie_width=16)
    c = preflight._fast_projection(few, fake_host(tmp_path, 1, cpuinfo="flags\t: fpu avx2 fma f16c\n"), lambda: [h200])
    assert c.level == "warn" and "3 CPU-tier threads (avx2), NVIDIA H200's PCIe link at 51.2 GB/s" in c.message
    assert "serve as exact mode does" in c.message
    many = config.load(["--mode", "fast", "--ct-threads", "23"], {})
    c = preflight._fast_projection(many, fake_host(tmp_path, 1, cpuinfo=flags), lambda: [])
    assert c.level == "ok" and "a PCIe 4 x16 link (nvidia-smi gave none) at 25 GB/s" in c.message
    assert float(c.message.split("take ")[1].split(" experts")[0]) >= 1.0
    assert preflight._fast_projection(many, fake_host(tmp_path, 1, cpuinfo="flags\t: fpu sse2\n"), lambda: []) is None


def test_the_widest_isa_the_cpu_tier_runs():
    assert preflight.widest_isa({"avx2", "fma", "f16c"}) == "avx2"
    assert preflight.widest_isa({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}) == "avx512"
    assert preflight.widest_isa({"avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_vnni"}) == "avx512vbmi"
    assert preflight.widest_isa({"avx", "sse4_2"}) is None
