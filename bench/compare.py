"""One run on a GPU machine that puts the project side by side with stock exllamav3 and the physical bounds.

    source .gpu/prep.sh && python3 -m bench.compare --out-dir $OUT            # scaled checkpoint, ~8 minutes
    source .gpu/prep.sh && python3 -m bench.compare --quick --out-dir $OUT    # tiny checkpoint smoke test

1. A synthetic checkpoint (``glm53 synth``; default ``scaled``: real shapes, 12 MoE layers) under ``--ckpt-root``,
   reused when one with the same preset, routing (``--routing``), seed, layer count and writer sources is there, with its routing profile
   as an ``EXL3_MOE_CPU_SPLIT_STATS`` file.
2. Bandwidths (``bench/bandwidth.py``, a process of its own): PCIe copy and zero-copy read, DRAM read, HBM copy.
3. The arms (``bench/compare_arm.py``), each in a fresh process with a timeout, so VRAM, patches and exllamav3's
   CPU worker never outlive their arm: ``stock-vram``, ``stock-mcs``, ``stock-mcs-pa``, ``exact``, ``fast``; the
   ``--repeat`` arm runs first and again last, so the spread between the two shows the noise (and drift).
   The GPU share of the offload arms is the same: ``--gpu-experts`` experts per layer (default: a 24 GB card's
   32 of 288, scaled to the checkpoint's expert count) stay in VRAM under ``-mcs``; the project arms get the VRAM
   limit that leaves their expert cache that many experts (derived from the all-VRAM arm's peak, or given).
4. Results: ``<out-dir>/<date>-<gpu>.json`` (written after every arm, so an interrupted run keeps what it had;
   schema in ``bench/scoreboard.py``), the chart ``<same>.png`` (``bench/chart.py``) and a table on stdout.

A failing arm does not stop the run: its status and the tail of its log are recorded. The whole run keeps to
``--budget-s`` (an arm that would not fit is reported as not run).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench import scoreboard
from glm53.config import GB

REPO = Path(__file__).resolve().parents[1]
SHIM_DIR = REPO / "bench" / "mcs_shim"
CUDA_CONTEXT_GB = 1.0  # CUDA context, cuBLAS workspaces: on the card, not in torch's allocation peak
CARD_GPU_EXPERTS, REAL_EXPERTS = 32, 288  # a 24 GB card holds ~32 of GLM-5.3-Flash's 288 experts per layer
MCS_ARMS = ("stock-mcs", "stock-mcs-pa")
NO_BANDWIDTH = {"pcie_h2d_gbs": None, "pcie_zero_copy_read_gbs": None, "dram_read_gbs": None, "hbm_copy_gbs": None}
T_START = time.monotonic()


def log(msg: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')} +{time.monotonic() - T_START:6.1f}s] {msg}", flush=True)


# ---- arguments ----

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python3 -m bench.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="scaled", help="synthetic checkpoint preset (default scaled)")
    ap.add_argument("--routing", default="random", choices=("random", "trained"),
                    help="the synthetic checkpoint's routing dynamics (glm53 synth --routing; default random)")
    ap.add_argument("--seed", type=int, default=1, help="checkpoint seed (default 1)")
    ap.add_argument("--moe-layers", type=int, help="MoE layers (default: the preset's, 12 for scaled)")
    ap.add_argument("--ckpt", type=Path, help="use this checkpoint instead of a synthetic one")
    ap.add_argument("--stats", type=Path, help="routing profile (EXL3_MOE_CPU_SPLIT_STATS file) for --ckpt")
    ap.add_argument("--ckpt-root", type=Path, default=Path("/tmp/glm53-compare"), help="where synthetic checkpoints are kept")
    ap.add_argument("--calibrate-rounds", type=int, default=0, help="run `glm53 calibrate-router` with this many rounds on a new checkpoint (default 0: off)")
    ap.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results", help="results directory")
    ap.add_argument("--name", help="results file stem (default <date>-<gpu>)")
    ap.add_argument("--arms", default=",".join(scoreboard.ARMS), help=f"arms to run, comma-separated (default {','.join(scoreboard.ARMS)}; "
                    f"also {', '.join(scoreboard.PREFETCH_ARMS)}: exact mode with prefetch, the router's prediction and the oracle's)")
    ap.add_argument("--repeat", help="the arm run twice, first and last (default stock-vram, none with --quick; 'none' for no repeat)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny checkpoint, few tokens, no repeat (a couple of minutes)")
    ap.add_argument("--decode-tokens", type=int, default=256, help="tokens per decode job (default 256)")
    ap.add_argument("--decode-context", type=int, default=512, help="prompt tokens before a decode job (default 512)")
    ap.add_argument("--decode-reps", type=int, default=2, help="decode jobs per arm (default 2; the median counts)")
    ap.add_argument("--long-context", type=int, default=0, help="project arms: also decode after a prompt of this many tokens, "
                    "first second against steady state (the elastic loan's return; default 0: off)")
    ap.add_argument("--project-args", default="", help="more glm53 settings for the project arms, e.g. \"--ct-enable 1\" "
                    "(recorded with the results)")
    ap.add_argument("--elastic", action="store_true", help="project arms: the expert cache fills the staging buffers' room too "
                    "and lends it back for each long prefill (the elastic loan; more slots, so a higher decode hit rate)")
    ap.add_argument("--streams", type=int, nargs="*", default=[2, 4], help="also decode this many streams at once, batched "
                    "(-ambs), each count in turn; the aggregate rate is reported (default 2 4; the option with no count leaves them out)")
    ap.add_argument("--warmup-tokens", type=int, default=32, help="tokens of the warm-up job (default 32)")
    ap.add_argument("--prefill", type=int, nargs="+", default=list(scoreboard.PREFILL_LENGTHS), help="prefill lengths (default 512 4096)")
    ap.add_argument("--prefill-reps", type=int, default=2, help="prompts per prefill length (default 2; the median counts)")
    ap.add_argument("--chunk-size", type=int, default=4096, help="prefill chunk of every arm (default 4096)")
    ap.add_argument("--gpu-experts", type=int, help="experts per layer kept in VRAM by the offload arms (default: 32/288 of the checkpoint's)")
    ap.add_argument("--mct", type=int, help="stock CPU-offload worker threads (-mct; default exllamav3's: physical cores - 1)")
    ap.add_argument("--vram-limit-gb", type=float, help="the project arms' --vram-limit-gb (default: derived, see above)")
    ap.add_argument("--arm-timeout", type=float, default=300, help="seconds one arm may take (default 300)")
    ap.add_argument("--budget-s", type=float, default=540, help="seconds the whole run may take (default 540: the device's 600 s less prep.sh)")
    ap.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth measurements")
    ap.add_argument("--link-emulate-gbs", type=float, help="the project arms run with GLM53_LINK_EMULATE_GBS at this rate (the in-band "
                    "emulation of a slower link: 25 for a PCIe 4 x16 card), checked by the bandwidth measurement; the stock arms "
                    "are not emulated (their decode reads no expert over the link; default: the full link)")
    ap.add_argument("--cold-triton", action="store_true", help="every arm starts with an empty Triton cache, so its load_seconds "
                    "include compiling the kernels (default: the cache the machine has, e.g. the GPU kit's)")
    ap.add_argument("--cpu-hog", help="run every arm beside a spinning process on each of these CPUs (a CPU list such as 0-7, "
                    "or 'all'; bench.cpu_hog): a busy host")
    if ap.parse_known_args(argv)[0].quick:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(preset="tiny", decode_tokens=64, decode_reps=1, prefill_reps=1, warmup_tokens=8, repeat="none")
    args = ap.parse_args(argv)
    if args.repeat is None:
        args.repeat = "stock-vram"
    args.arm_list = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arm_list if a not in scoreboard.ALL_ARMS]
    if unknown:
        ap.error(f"unknown arm {unknown[0]!r}; choose from {', '.join(scoreboard.ALL_ARMS)}")
    if args.repeat != "none" and args.repeat not in args.arm_list:
        ap.error(f"--repeat {args.repeat} is not among the arms")
    if args.decode_tokens < 2 or args.decode_context < 1 or min(args.prefill) < 1 or min(args.decode_reps, args.prefill_reps) < 1:
        ap.error("--decode-tokens takes at least 2, the other counts at least 1")
    return args


def arm_sequence(arms: list[str], repeat: str) -> list[tuple[str, int]]:
    """(arm, run) in the order they run: the repeated arm first and last, the others in between."""
    order = [a for a in scoreboard.ALL_ARMS if a in arms]
    if repeat == "none":
        return [(a, 1) for a in order]
    rest = [(a, 1) for a in order if a != repeat]
    return [(repeat, 1)] + rest + [(repeat, 2)]


def cache_tokens(args) -> int:
    per_stream = args.decode_context + args.decode_tokens + 256  # the cache's pages are shared by the streams
    need = max(max(args.prefill), args.decode_context + args.decode_tokens, 64 + args.warmup_tokens,
               args.long_context + args.decode_tokens, max([0, *args.streams]) * per_stream) + 256
    # exllamav3's load runs one chunk-sized forward over the cache ("Cache too small for batch shape" otherwise)
    return -(-max(need, args.chunk_size) // 256) * 256


# ---- machine and checkpoint ----

def gpu_short_name(name: str) -> str:
    """``NVIDIA H200`` -> ``h200``; ``NVIDIA GeForce RTX 3090`` -> ``rtx3090``."""
    words = [w for w in name.lower().replace("-", " ").split() if w not in ("nvidia", "geforce", "tesla")]
    return "".join(c for c in "".join(words) if c.isalnum()) or "gpu"


def machine_info() -> dict:
    from glm53.engine.exl3.core_order import core_order
    from glm53.host import meminfo, query_gpus

    info = {"gpu": None, "gpu_memory_gb": None, "driver": None, "cpu": platform.processor() or None,
            "cores_logical": os.cpu_count(), "cores_physical": core_order()[1],
            "ram_gb": meminfo(Path("/proc/meminfo")).get("MemTotal", 0) / GB}
    try:
        gpus = query_gpus()
        if gpus:
            info.update(gpu=gpus[0].name, gpu_memory_gb=gpus[0].total / GB)
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=False)
        info["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired) as exc:
        log(f"nvidia-smi: {exc}")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def versions() -> dict:
    import torch

    def dist(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    git = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False)
    from glm53 import __version__

    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "exllamav3": dist("exllamav3"), "glm53": __version__, "git": git.stdout.strip() if git.returncode == 0 else None}


def checkpoint_key(preset: str, seed: int, moe_layers: int | None, calibrate_rounds: int = 0, routing: str = "random") -> str:
    """Names a synthetic checkpoint by what determines its bytes: the arguments and the writer's sources."""
    digest = hashlib.sha256(f"{preset}|{seed}|{moe_layers}|{calibrate_rounds}|{routing}".encode())
    for path in sorted((REPO / "glm53" / "tools" / "synth").glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def prepare_checkpoint(args) -> tuple[Path, Path | None, bool]:
    """(checkpoint dir, routing stats file or None, reused)."""
    if args.ckpt is not None:
        return args.ckpt, args.stats, True
    key = checkpoint_key(args.preset, args.seed, args.moe_layers, args.calibrate_rounds, args.routing)
    out = args.ckpt_root / f"{args.preset}-{key}"
    stats, done = out / "routing-stats.json", out / ".complete"
    if done.is_file():
        log(f"reusing checkpoint {out}")
        return out, stats, True
    cmd = [sys.executable, "-m", "glm53", "synth", "--preset", args.preset, "--seed", str(args.seed), "--out", str(out),
           "--routing", args.routing, "--stats-out", str(stats), "--force"]
    if args.moe_layers:
        cmd += ["--moe-layers", str(args.moe_layers)]
    log("writing checkpoint: " + shlex.join(cmd))
    subprocess.run(cmd, cwd=REPO, check=True)
    if args.calibrate_rounds:
        cal = [sys.executable, "-m", "glm53", "calibrate-router", "-m", str(out), "--rounds", str(args.calibrate_rounds),
               "--report", str(out / "calibration.json")]
        log("calibrating router: " + shlex.join(cal))
        subprocess.run(cal, cwd=REPO, check=True)
    done.write_text(datetime.now(UTC).isoformat() + "\n")
    return out, stats, False


def card_gpu_experts(experts: int) -> int:
    """The VRAM slots per MoE layer the offload arms keep for a checkpoint of ``experts`` routed experts a layer: a 24 GB
    card's share of GLM-5.3-Flash's."""
    return max(1, round(CARD_GPU_EXPERTS * experts / REAL_EXPERTS))


def checkpoint_info(ckpt: Path, stats: Path | None, gpu_experts: int | None, args, reused: bool) -> dict:
    from glm53.models.checkpoint import expert_bytes, read_config, shards

    cfg = read_config(ckpt)
    text = cfg.get("text_config", cfg)
    experts, top_k = text["n_routed_experts"], text["num_experts_per_tok"]
    routed = expert_bytes(ckpt).routed
    moe_layers = sum(1 for t in text.get("mlp_layer_types", []) if t == "sparse") or (args.moe_layers or 0)
    k = gpu_experts or card_gpu_experts(experts)
    profile = json.loads(stats.read_text()) if stats and stats.is_file() else None
    synth = cfg.get("glm53_synth", {})
    return {
        "preset": synth.get("preset", args.preset), "seed": synth.get("seed", args.seed), "moe_layers": moe_layers,
        "routing": synth.get("routing", {}).get("preset", "random") if synth else None,
        "experts": experts, "top_k": top_k, "dir": str(ckpt), "bytes": sum(p.stat().st_size for p in shards(ckpt)),
        "routed_expert_bytes": routed, "expert_bytes": routed / (moe_layers * experts) if moe_layers else None,
        "gpu_experts": k, "stats_file": str(stats) if profile else None,
        "profile_hit_rate": scoreboard.profile_hit_rate(profile, k) if profile else None,
        "reused": reused, "calibrated": (ckpt / "calibration.json").is_file(),
    }


def project_vram_limit_gb(allvram_peak_gb: float | None, ckpt_bytes: int, routed_bytes: int, gpu_share: float,
                          reserve_gb: float, staging_gb: float, allowance_gb: float = 2.0,
                          context_gb: float = CUDA_CONTEXT_GB) -> tuple[float, str]:
    """The emulated card for the project arms: what the all-VRAM arm needed at its peak, minus the experts that
    do not fit in the GPU share, plus the cache's reserve, the two prefill staging buffers and the CUDA context
    (which torch's peak does not count). A 24 GB card gets its staging buffers by lending ~10 GB of its 13 GB
    expert cache during prefill; the layer-scaled checkpoint's cache (the same share of far fewer layers) is too
    small to lend that, so the buffers are budgeted directly. The cache itself is held to the share with
    ``--ec-cache-experts``. Without an all-VRAM measurement, the checkpoint's bytes plus ``allowance_gb`` for
    caches and activations stand in for the peak."""
    off = (1.0 - gpu_share) * routed_bytes / GB
    extra = reserve_gb + staging_gb + context_gb
    if allvram_peak_gb is not None:
        return allvram_peak_gb - off + extra, "stock-vram peak allocated - offloaded experts + reserve + staging + CUDA context"
    return ckpt_bytes / GB + allowance_gb - off + extra, f"checkpoint bytes + {allowance_gb} GB - offloaded experts + reserve + staging + CUDA context"


# ---- running things ----

def remount_shm(size: str = "16G") -> dict:
    """exllamav3's pinned arena wants room in /dev/shm for its handoff segment; grow it where we are root."""
    from glm53.host import shm_bytes

    before = shm_bytes(Path("/dev/shm"))
    out = {"size_before_gb": before / GB if before else None, "remount_attempted": False, "ok": None}
    if hasattr(os, "geteuid") and os.geteuid() == 0 and (before or 0) < 8 * GB:
        proc = subprocess.run(["mount", "-o", f"remount,size={size}", "/dev/shm"], capture_output=True, text=True, check=False)
        out.update(remount_attempted=True, ok=proc.returncode == 0, message=(proc.stderr or proc.stdout).strip() or None)
    after = shm_bytes(Path("/dev/shm"))
    out["size_after_gb"] = after / GB if after else None
    return out


def run_process(cmd: list[str], env: dict, log_path: Path, timeout: float) -> tuple[int | None, float]:
    """(exit status or None on timeout, seconds). The process gets its own session, so a timeout kills it and
    everything it started (exllamav3's CPU worker)."""
    t0 = time.monotonic()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, time.monotonic() - t0


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def arm_env(arm: str, stats: Path | None, work: Path, cold_triton: bool = False) -> dict:
    env = dict(os.environ)
    if cold_triton:  # nothing compiled yet: the load's warm-up compiles every kernel it needs
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-", dir=work)
    paths = [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    if arm in MCS_ARMS:
        paths.insert(0, str(SHIM_DIR))  # the core-order shim, for this arm and its CPU worker only
        env["EXL3_MOE_CPU_PIN"] = "0"
        if stats is not None and stats.is_file():
            env["EXL3_MOE_CPU_SPLIT_STATS"] = str(stats)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # exllamav3 (under the cache home) and glm53 (under the data home) save learned expert placements and reload
    # them in the next process: fresh ones per arm, so no arm starts from what an earlier one learned
    env["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="xdg-cache-", dir=work)
    env["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="xdg-data-", dir=work)
    return env


def run_arm(arm: str, run: int, spec: dict, stats: Path | None, work: Path, logs: Path, timeout: float,
            cold_triton: bool = False) -> dict:
    spec_path = work / f"{arm}-{run}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path = work / f"{arm}-{run}.result.json"
    log_path = logs / f"{arm}-{run}.log"
    cmd = [sys.executable, "-m", "bench.compare_arm", "--arm", arm, "--spec", str(spec_path), "--result", str(result_path)]
    rc, seconds = run_process(cmd, arm_env(arm, stats, work, cold_triton), log_path, timeout)
    if result_path.is_file():
        result = json.loads(result_path.read_text())
    elif rc is None:
        result = {"status": "timeout", "error_tail": f"killed after {timeout:.0f} s\n" + tail(log_path)}
    else:
        result = {"status": "error", "error_tail": f"exit status {rc}, no result\n" + tail(log_path)}
    if result["status"] == "error" and "error_tail" in result:
        result["error_tail"] = result["error_tail"] + "\n--- log tail ---\n" + tail(log_path, 15)
    return {"name": arm, "run": run, **result, "seconds": round(seconds, 1), "log": log_path.name}


def bandwidth(quick: bool, logs: Path, work: Path, timeout: float, link_emulate_gbs: float | None = None) -> dict:
    out = work / "bandwidth.json"
    cmd = [sys.executable, "-m", "bench.bandwidth", "--out", str(out)] + (["--gib", "0.25", "--dram-gib", "1"] if quick else []) \
        + (["--link-emulate-gbs", str(link_emulate_gbs)] if link_emulate_gbs else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    rc, _ = run_process(cmd, env, logs / "bandwidth.log", timeout)
    if rc == 0 and out.is_file():
        return json.loads(out.read_text())
    log(f"bandwidth measurement failed (exit {rc}); see {logs.name}/bandwidth.log")
    return NO_BANDWIDTH | {"error_tail": tail(logs / "bandwidth.log")}


def unpack_tiny_triton_cache() -> None:
    """The GPU kit's Triton kernels for the tiny checkpoint (else the first tiny load compiles for ~100 s)."""
    archive, target = REPO / ".gpu" / "triton-cache-tiny.tgz", os.environ.get("TRITON_CACHE_DIR")
    if archive.is_file() and target:
        Path(target).mkdir(parents=True, exist_ok=True)
        subprocess.run(["tar", "xzf", str(archive), "-C", target], check=False)


# ---- the run ----

def measurement_spec(args, ckpt: Path) -> dict:
    return {"ckpt": str(ckpt), "cache_tokens": cache_tokens(args), "chunk_size": args.chunk_size, "seed": args.seed,
            "decode_tokens": args.decode_tokens, "decode_context": args.decode_context, "decode_reps": args.decode_reps,
            "warmup_tokens": args.warmup_tokens, "prefill_lengths": args.prefill, "prefill_reps": args.prefill_reps,
            "mct": args.mct, "long_context": args.long_context, "streams": args.streams, "project_args": shlex.split(args.project_args),
            "link_emulate_gbs": args.link_emulate_gbs}


def write_results(results: dict, path: Path) -> None:
    scoreboard.finish(results)
    path.write_text(json.dumps(results, indent=1) + "\n")


def build_native_libraries() -> None:
    """The project's native libraries built (when the source tree has none up to date) before any arm starts: a
    first build (about half a minute each on a fresh machine) is no part of an arm's load time or timeout."""
    import torch

    from glm53.cpu_tier import kernel as cpu_expert
    from glm53.native import cuda
    from glm53.native import libraries as native_lib

    t0 = time.monotonic()
    libraries = [("CPU tier", cpu_expert.locate)] + ([("expert cache", cuda.locate)] if torch.cuda.is_available() else [])
    for name, locate in libraries:
        try:
            log(f"{name} library: {locate().name} ({time.monotonic() - t0:.1f} s)")
        except native_lib.NativeBuildError as exc:  # the arms that need it report it
            log(f"{name} library: not available: {exc}")


def main(argv=None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    stem = args.name or f"{datetime.now(UTC):%Y-%m-%d}-{gpu_short_name(machine['gpu'] or 'gpu')}"
    out_json, logs = args.out_dir / f"{stem}.json", args.out_dir / f"{stem}-logs"
    logs.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="glm53-compare-"))
    log(f"{machine['gpu']}, {machine['cpu']}, {machine['cores_logical']} CPUs; results -> {out_json}")

    if any(a in scoreboard.PROJECT_ARMS for a in args.arm_list):
        build_native_libraries()
    ckpt, stats, reused = prepare_checkpoint(args)
    ckpt_info = checkpoint_info(ckpt, stats, args.gpu_experts, args, reused)
    if ckpt_info["preset"] == "tiny":
        unpack_tiny_triton_cache()
    spec = {**measurement_spec(args, ckpt), "mcs": ckpt_info["experts"] - ckpt_info["gpu_experts"]}
    log(f"checkpoint {ckpt}: {ckpt_info['bytes'] / GB:.1f} GB, {ckpt_info['moe_layers']} MoE layers x {ckpt_info['experts']} "
        f"experts; offload arms keep {ckpt_info['gpu_experts']} per layer in VRAM (-mcs {spec['mcs']})")
    results = {
        "schema": scoreboard.SCHEMA, "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "source .gpu/prep.sh && python3 -m bench.compare " + shlex.join(argv), "argv": argv,
        "machine": machine, "versions": versions(), "checkpoint": ckpt_info, "settings": spec,
        "shm": remount_shm() if "stock-mcs-pa" in args.arm_list else None, "arms": [], "chart": None,
    }
    with contextlib.ExitStack() as stack:
        results["bandwidth"] = NO_BANDWIDTH | {"skipped": True} if args.no_bandwidth else \
            bandwidth(args.quick, logs, work, 180, args.link_emulate_gbs)
        log("bandwidth: " + ", ".join(f"{k} {v:.1f}" for k, v in results["bandwidth"].items() if k.endswith("_gbs") and v))
        if args.link_emulate_gbs:
            check = results["bandwidth"].get("link_emulation") or {}
            results["link_emulation"] = {"target_gbs": args.link_emulate_gbs, "arms": "project arms (stock arms at the full link)",
                                         "check": check}
            log(f"link emulation at {args.link_emulate_gbs} GB/s: bandwidth check {'valid' if check.get('valid') else 'NOT valid'}: "
                f"{check.get('targets')}")
        if args.cpu_hog:
            from bench.cpu_hog import CpuHog, parse_cpus

            cpus = sorted(os.sched_getaffinity(0)) if args.cpu_hog == "all" else parse_cpus(args.cpu_hog)
            stack.enter_context(CpuHog(cpus))
            results["cpu_hog"] = {"cpus": cpus}
            log(f"CPU hog on CPUs {cpus}")
        write_results(results, out_json)
        run_arms(args, results, spec, stats, work, logs, out_json)
    results["chart"] = _chart(results, args.out_dir / f"{stem}.png")
    write_results(results, out_json)
    for problem in scoreboard.validate(results):
        log(f"results: {problem}")
    from bench.readme_measured import measured_block

    print(measured_block(results, out_json.name), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    log(f"done: {out_json}")
    return 0


def run_arms(args, results: dict, spec: dict, stats: Path | None, work: Path, logs: Path, out_json: Path) -> None:
    """Every arm in turn, within the time budget; the results file is rewritten after each."""
    ckpt_info = results["checkpoint"]
    for arm, run in arm_sequence(args.arm_list, args.repeat):
        left = args.budget_s - (time.monotonic() - T_START) - 20
        if left < 30:
            results["arms"].append({"name": arm, "run": run, "status": "not available", "reason": f"out of the {args.budget_s:.0f} s budget"})
            log(f"{arm} (run {run}): skipped, out of time")
            continue
        arm_spec, extra = dict(spec), {}
        if arm in scoreboard.PROJECT_ARMS:
            arm_spec["vram_limit_gb"], source = _project_limit(args, results, ckpt_info, arm)
            # --elastic: no cap, the cache takes the staging room as well and lends it for each long prefill
            arm_spec["cache_experts"] = None if args.elastic else ckpt_info["gpu_experts"] * ckpt_info["moe_layers"]
            extra = {"vram_limit_gb": arm_spec["vram_limit_gb"], "vram_limit_source": source, "cache_experts": arm_spec["cache_experts"]}
            log(f"{arm}: --vram-limit-gb {arm_spec['vram_limit_gb']:.2f} ({source})")
        if arm in MCS_ARMS:
            extra = {"placement": "hot-first (EXL3_MOE_CPU_SPLIT_STATS)" if ckpt_info["stats_file"] else "exllamav3 default"}
        timeout = min(args.arm_timeout, left)
        log(f"{arm} (run {run}): starting, timeout {timeout:.0f} s")
        entry = {**run_arm(arm, run, arm_spec, stats, work, logs, timeout, cold_triton=args.cold_triton), **extra,
                 "triton_cache": "cold" if args.cold_triton else "as found"}
        results["arms"].append(entry)
        log(f"{arm} (run {run}): {_outcome(entry)}")
        write_results(results, out_json)


def _project_limit(args, results: dict, ckpt_info: dict, arm: str) -> tuple[float, str]:
    if args.vram_limit_gb:
        return args.vram_limit_gb, "given"
    from glm53 import config

    peaks = [a["vram_max_allocated_gb"] for a in scoreboard.ok_runs(results, "stock-vram")]
    settings = config.load(["--mode", "exact" if arm in scoreboard.PREFETCH_ARMS else arm], {})
    return project_vram_limit_gb(max(peaks) if peaks else None, ckpt_info["bytes"], ckpt_info["routed_expert_bytes"],
                                 ckpt_info["gpu_experts"] / ckpt_info["experts"], settings.ec_reserve_gb, 2 * settings.ec_stage_gb)


def _outcome(entry: dict) -> str:
    if entry["status"] == "ok":
        prefill = ", ".join(f"{k}: {v:.0f}" for k, v in entry["prefill_tok_s"].items())
        return f"ok in {entry['seconds']} s; decode {entry['decode_tok_s']:.1f} tok/s, prefill tok/s {prefill}"
    why = (entry.get("reason") or entry.get("error_tail") or "").strip().splitlines()
    return f"{entry['status']} after {entry.get('seconds', 0)} s: {why[-1] if why else ''}"


def _chart(results: dict, path: Path) -> str | None:
    from bench.chart import render

    try:
        render(results, path)
    except ImportError as exc:  # matplotlib is not installed here
        log(f"no chart: {exc}")
        return None
    log(f"chart: {path}")
    return path.name


if __name__ == "__main__":
    sys.exit(main())
