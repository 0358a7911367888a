#!/usr/bin/env bash
# Issue 29's measurement set on a GPU machine: fast mode against exact mode and stock exllamav3 where users run it (a
# slower host link, emulated in band: glm53/offload/link.py), the emulation's own validation, the CPU kernel's
# per-job cost, and fast mode's quality with the int16 codebook. Each phase fits one device call (10 minutes); several
# phases may be named, and `all` runs every one in order. Results go to $WORK/<phase>/ and are packed into $OUT/<phase>.tgz (the device sends back a few
# files only); a step that fails is logged and the next one runs.
#
#   source .gpu/prep.sh && bench/run_fast_link.sh check     # the emulation's rates (bench.bandwidth), the CPU kernel's
#   source .gpu/prep.sh && bench/run_fast_link.sh tests     # the GPU tests of the emulation, the int16 expert, fast mode
#   source .gpu/prep.sh && bench/run_fast_link.sh sweep     # bench.compare at 25 GB/s with stock's -mcs, bench.link_sweep
#   source .gpu/prep.sh && bench/run_fast_link.sh streams   # bench.compare of exact and fast at 25 and 12.5 GB/s, 1 and 4 streams
#   source .gpu/prep.sh && bench/run_fast_link.sh quality   # paired decode KL (int16) against the noise floor
#   source .gpu/prep.sh && bench/run_fast_link.sh ablation  # bench.fast_ablation at 25 GB/s (the tier's rules)
#   source .gpu/prep.sh && bench/run_fast_link.sh fullsize  # 22 MoE layers on one GPU, then bench.extrapolate --measured
#
# GPU_TESTS: the test files of `tests` (default: the link emulation's, the CPU expert's, fast mode's, exactness);
# GPU_KIT: the device kit (default .gpu); CKPT_ROOT: where checkpoints are written (default /tmp/glm53-compare). A CPU
# library built elsewhere is taken from $GLM53_NATIVE_BUILD (the device kit may carry one: .gpu/native/).
set -uo pipefail
cd "$(dirname "$0")/.."
PHASES="check tests sweep streams quality ablation fullsize"
WORK=${WORK:-/tmp/glm53-fast-link-work}
OUT=${OUT:-/tmp/glm53-fast-link}
source bench/device/phases.sh

scaled_checkpoint() {  # the scaled checkpoint bench.compare wrote (or reuses)
	ls -d "$CKPT_ROOT"/scaled-* 2>/dev/null | head -1
}

tests() {
	# these files only (tests/gpu/run.sh runs the whole suite, whose constrained-decoding tests need jsonschema, which the
	# device lacks)
	export TEST_CHECKPOINT=/tmp/glm53-ckpt/tiny
	[ -e "$TEST_CHECKPOINT/config.json" ] || python3 -m glm53 synth --preset tiny --out "$TEST_CHECKPOINT" --seed 1 --force >/dev/null
	step gpu-tests 400 python3 -m pytest -v -rA -p no:cacheprovider ${GPU_TESTS:-tests/gpu/test_link_emulation.py \
		tests/gpu/test_cpu_expert_vs_exl3.py tests/gpu/test_fast_tier.py tests/gpu/test_offload_exact.py}
}

check() {
	step native-build 240 python3 -c 'from glm53.native import cuda; from glm53.cpu_tier import kernel; print(cuda.locate(), kernel.locate())'
	step bandwidth 120 python3 -m bench.bandwidth --gib 1 --link-emulate-gbs 12.5 25 50 --out "$dir/bandwidth-link-emulation.json"
	# a one-expert job against a batch, by threads and unit size (the per-job cost: 312 us on 16 CPUs last round)
	step cpu-kernel-1 150 python3 bench/cpu_expert_bw.py --cpus 0-15 --cores 4 8 16 --isa avx512vbmi --codebook int16 \
		--per-call 1 --units-per-thread 4 8 16 --reps 2 --out "$dir/cpu-expert-bw-1-per-call.json"
	step cpu-kernel-8 120 python3 bench/cpu_expert_bw.py --cpus 0-15 --cores 8 16 --isa avx512vbmi --codebook fma --codebook int16 \
		--per-call 8 --reps 2 --out "$dir/cpu-expert-bw-8-per-call.json"
}

sweep() {
	step compare-25 420 python3 -m bench.compare --arms stock-mcs,exact,fast --streams 4 --decode-reps 2 --decode-tokens 128 \
		--prefill 512 --prefill-reps 1 --repeat none --link-emulate-gbs 25 --arm-timeout 150 --budget-s 400 \
		--ckpt-root "$CKPT_ROOT" --out-dir "$dir" --name compare-25
	local ckpt
	ckpt=$(scaled_checkpoint)
	step link-sweep 300 python3 -m bench.link_sweep -m "$ckpt" --gbs full measured 25 12.5 --tokens 96 \
		--engine-args "$CARD" --out "$dir/link-sweep.json"
}

streams() {
	local gbs
	for gbs in 25 12.5; do
		step "compare-$gbs" 240 python3 -m bench.compare --arms exact,fast --streams 4 --decode-reps 2 --decode-tokens 128 \
			--prefill 512 --prefill-reps 1 --repeat none --link-emulate-gbs "$gbs" --arm-timeout 110 --budget-s 230 \
			--ckpt-root "$CKPT_ROOT" --out-dir "$dir" --name "compare-$gbs"
	done
}

quality() {
	local ckpt
	ckpt=$(scaled_checkpoint)
	if [ -z "$ckpt" ]; then
		step synth 120 python3 -m glm53 synth --preset scaled --seed 1 --out "$CKPT_ROOT/scaled-quality" --force
		ckpt=$CKPT_ROOT/scaled-quality
	fi
	step kl-floor 150 python3 -m bench.decode_kl -m "$ckpt" --a stock --b perturbed:0.001 --tokens 48 --max-prompts 3 \
		--out "$dir/decode-kl-floor.json"
	step kl-fast-int16 200 python3 -m bench.decode_kl -m "$ckpt" --a exact --b fast --split all --tokens 48 --max-prompts 3 \
		--engine-args "$CARD" --out "$dir/decode-kl-fast-int16-all.json"
}

ablation() {  # the tier's rules (rest, probes, the hooks' currency) at 25 GB/s
	step fast-ablation-25 400 python3 -m bench.fast_ablation -m "$(scaled_checkpoint)" --tokens 96 \
		--engine-args "$CARD --ct-enable 1 --link-emulate-gbs 25" --out "$dir/fast-ablation-25.json"
}

fullsize() {
	step compare-22 560 python3 -m bench.compare --moe-layers 22 --arms stock-mcs,exact,fast,stock-vram --streams 4 \
		--prefill 512 4096 --decode-reps 1 --decode-tokens 96 --repeat none --arm-timeout 140 --budget-s 540 \
		--ckpt-root "$CKPT_ROOT" --out-dir "$dir" --name compare-22
}

run_phases "$@"
