#!/usr/bin/env bash
# The offload layer checked and measured on a GPU machine before and after a change to it: exactness (the store,
# cache, staging and prefetch against stock exllamav3), the cache policy's kernel against its reference, and
# bench.compare of exact mode, exact mode with prefetch (the router's prediction and the oracle's) and fast mode on
# the 12-MoE-layer scaled checkpoint of each routing preset, with the real engine's routing statistics beside them.
# A phase fits one device call (10 minutes); results go to $WORK/<phase>/ and are packed into $OUT/<phase>.tgz.
#
#   source .gpu/prep.sh && bench/run_offload_checks.sh trained   # bench.compare on `trained` routing, routing_stats --engine
#                                                                # (its trace, for bench.cache_policy_sim --trace), disk_bw
#   source .gpu/prep.sh && bench/run_offload_checks.sh random    # the same on `random` routing
#   source .gpu/prep.sh && bench/run_offload_checks.sh tests     # the GPU tests of exactness, the policy kernel, prefetch, fast mode
#   source .gpu/prep.sh && bench/run_offload_checks.sh scaled-exact  # exactness (prefetch cases too) on the scaled checkpoint
#   source .gpu/prep.sh && bench/run_offload_checks.sh ram-tier    # exact decode and prefill 4096 with RAM for 100 / 50 / 25 %
#                                                                # of the experts (the rest read from disk), against the bound
#   source .gpu/prep.sh && bench/run_offload_checks.sh ram-tier-reader  # disk_bw in decode's pattern, full RAM and 50 % against
#                                                                # the bound, and the reader's pieces A/B/A at 50 % (two calls:
#                                                                # bench/device/background.sh)
#   source .gpu/prep.sh && bench/run_offload_checks.sh ram-tier-ahead  # reads ahead against none at 50 % RAM, A/B/A
#   source .gpu/prep.sh && bench/run_offload_checks.sh ram-tier-write-back  # VRAM's evictions written back, against none, A/B/A
#   source .gpu/prep.sh && bench/run_offload_checks.sh ram-tier-fast  # fast mode (its CPU tier beside the RAM tier) against
#                                                                # exact at 50 % RAM, A/B/A
#   source .gpu/prep.sh && bench/run_offload_checks.sh prefetch-gate  # prefetch with its precision gate, on `trained` and `random`
#   source .gpu/prep.sh && bench/run_offload_checks.sh policy-ab   # exact mode on `trained` with the two-timescale cache policy
#                                                                # against the popularity-only one it replaced, A/B/A
#   source .gpu/prep.sh && bench/run_offload_checks.sh ram-policy-ab  # exact mode at 50 % RAM with the RAM tier's policy
#                                                                # against RAM_POLICY_OLD_ARGS (default: its first policy), A/B/A
#   source .gpu/prep.sh && bench/run_offload_checks.sh prefetch-budget  # prefetch with 1 slot, what one layer's attention
#                                                                # window carries on this host, against 2, on `trained`
#   source .gpu/prep.sh && bench/run_offload_checks.sh prefetch-threshold  # exact against exact-prefetch with the
#                                                                # threshold and the measured copy budget, on `trained` and `random`
#
# ARMS: bench.compare's arms (default exact,exact-prefetch,exact-oracle,fast); GPU_TESTS: the test files of `tests`, GPU_K
# a pytest -k expression over them;
# SCALED_CHECKPOINT: also run exactness on that scaled checkpoint (with prefetch on).
cd "$(dirname "$0")/.."
PHASES="trained random tests scaled-exact prefetch-budget prefetch-threshold policy-ab prefetch-gate ram-tier ram-tier-reader ram-tier-ahead ram-tier-write-back ram-tier-fast ram-policy-ab cpu-tier-ring"
WORK=${WORK:-/tmp/glm53-offload-checks}
source bench/device/phases.sh
ARMS=${ARMS:-exact,exact-prefetch,exact-oracle,fast}

compare_routing() {  # compare_routing ROUTING: the arms on that preset's checkpoint, then the engine's routing figures
	local routing=$1 ckpt
	step "compare-$routing" 470 python3 -m bench.compare --routing "$routing" --arms "$ARMS" --streams --decode-reps 2 \
		--decode-tokens 128 --prefill 512 --prefill-reps 1 --repeat none --arm-timeout 110 --budget-s 450 \
		--ckpt-root "$CKPT_ROOT" --out-dir "$dir" --name "compare-$routing"
	ckpt=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["checkpoint"]["dir"])' "$dir/compare-$routing.json" 2>/dev/null)
	[ -n "$ckpt" ] || return 0
	step "routing-stats-$routing" 100 python3 -m bench.routing_stats --ckpt "$ckpt" --engine --tokens 256 \
		--engine-args "$CARD" --out "$dir/routing-stats-engine-$routing.json" --trace-out "$dir/routing-trace-$routing.npy" \
		--logits-out "$dir/routing-logits-$routing.npz"
	# the cache policy with the router's soft score on the engine's own routing (CPU; issue 33)
	step "soft-score-$routing" 120 python3 -m bench.cache_policy_soft --engine-trace "$dir/routing-trace-$routing.npy" \
		"$dir/routing-logits-$routing.npz" --synth-preset scaled --slots 384 --grid full --out "$dir/soft-score-engine-$routing.json"
}

trained() {
	compare_routing trained
	step disk-bw 60 python3 bench/disk_bw.py --file /tmp/disk_bw.scratch --experts 48 --depths 1,4,16 --reps 2 \
		--out "$dir/disk-bw.json"
	# the same with records on block boundaries: what the bounce buffer costs (O_DIRECT was slower than buffered here)
	step disk-bw-aligned 60 python3 bench/disk_bw.py --file /tmp/disk_bw.scratch --experts 48 --depths 1,4,16 --reps 2 \
		--offset-skew 0 --out "$dir/disk-bw-aligned.json"
}

random() {
	compare_routing random
}

tests() {
	export TEST_CHECKPOINT=/tmp/glm53-ckpt/tiny
	[ -e "$TEST_CHECKPOINT/config.json" ] || python3 -m glm53 synth --preset tiny --out "$TEST_CHECKPOINT" --seed 1 --force >/dev/null
	step gpu-tests 540 python3 -m pytest -v -rA -p no:cacheprovider ${GPU_TESTS:-tests/gpu/test_offload_exact.py \
		tests/gpu/test_cache_policy_kernel.py tests/gpu/test_prefetch.py tests/gpu/test_fast_tier.py} ${GPU_K:+-k "$GPU_K"}
}

scaled-exact() {  # test_offload_exact on the 12-MoE-layer checkpoint as well as the tiny one (about 3 minutes more);
	# SCALED_K: a pytest -k expression to run part of it (SCALED_CHECKPOINT may name bench.compare's, routing aside the same)
	export TEST_CHECKPOINT=/tmp/glm53-ckpt/tiny SCALED_CHECKPOINT=${SCALED_CHECKPOINT:-$CKPT_ROOT/scaled-exact}
	[ -e "$TEST_CHECKPOINT/config.json" ] || python3 -m glm53 synth --preset tiny --out "$TEST_CHECKPOINT" --seed 1 --force >/dev/null
	[ -e "$SCALED_CHECKPOINT/config.json" ] || step synth-scaled 200 python3 -m glm53 synth --preset scaled --seed 1 \
		--out "$SCALED_CHECKPOINT" --force
	step gpu-tests-scaled 380 python3 -m pytest -v -rA -p no:cacheprovider tests/gpu/test_offload_exact.py ${SCALED_K:+-k "$SCALED_K"}
}

prefetch-budget() {  # 2 slots' copies (344 us at 55 GB/s) overrun the ~165 us between two layers: does 1 slot gain?
	local slots
	for slots in 1 2; do
		step "compare-trained-slots-$slots" 280 python3 -m bench.compare --routing trained --arms exact,exact-prefetch \
			--project-args "--prefetch-slots $slots" --streams --decode-reps 2 --decode-tokens 128 --prefill 512 \
			--prefill-reps 1 --repeat none --arm-timeout 110 --budget-s 260 --ckpt-root "$CKPT_ROOT" --out-dir "$dir" \
			--name "compare-trained-slots-$slots"
	done
}

prefetch-threshold() {  # GLM53_PREFETCH_MIN_SCORE and the window budget (PREFETCH_ARGS: the calibrated threshold and the budget)
	local routing
	for routing in ${ROUTINGS:-trained random}; do
		step "compare-$routing-threshold" 260 python3 -m bench.compare --routing "$routing" --arms exact,exact-prefetch \
			--project-args "${PREFETCH_ARGS:---prefetch-min-score 0.855 --prefetch-window-budget 1}" \
			--streams --decode-reps 2 --decode-tokens 128 --prefill 512 --prefill-reps 1 --repeat none --arm-timeout 110 \
			--budget-s 240 --ckpt-root "$CKPT_ROOT" --out-dir "$dir" --name "compare-$routing-threshold"
	done
}

prefetch-gate() {  # issue 33's live precision gate: exact against exact-prefetch with GLM53_PREFETCH_MIN_PRECISION
	local routing
	for routing in ${ROUTINGS:-trained random}; do
		step "compare-$routing-gate" 260 python3 -m bench.compare --routing "$routing" --arms exact,exact-prefetch \
			--project-args "--prefetch-min-precision ${PREFETCH_MIN_PRECISION:-0.5}" --streams --decode-reps 2 --decode-tokens 128 \
			--prefill 512 --prefill-reps 1 --repeat none --arm-timeout 110 --budget-s 240 --ckpt-root "$CKPT_ROOT" --out-dir "$dir" \
			--name "compare-$routing-gate"
	done
}

policy-ab() {  # the cache policy's share of a before/after difference: the same code, the old policy's settings
	# (POLICY_OLD_ARGS, default the defaults before 2026-12-02's retune: decay 0.999, recency weight 800)
	local run args
	for run in new-1 old new-2; do
		args=""
		[ "$run" = old ] && args=${POLICY_OLD_ARGS:---ec-decay 0.999 --ec-recency-weight 800}
		step "compare-trained-policy-$run" 150 python3 -m bench.compare --routing trained --arms exact --project-args "$args" \
			--streams --decode-reps 3 --decode-tokens 128 --prefill 512 --prefill-reps 1 --repeat none --arm-timeout 110 \
			--budget-s 140 --ckpt-root "$CKPT_ROOT" --out-dir "$dir" --name "compare-trained-policy-$run"
	done
}

ram-tier() {  # issue 32: a RAM tier of 50 % and 25 % of the experts against all of them, on `trained` routing
	# RAM_SHARES: the shares to run (default 100 50 25; 100 also runs stock-vram, for the bound's step time);
	# RAM_PREFILL: the prefill length (default 4096, the issue's; a short one leaves time for decode at small shares);
	# RAM_NO_DISK_BW=1: no disk_bw pass (the bound then takes the rate the tier's own reads ran at)
	local ckpt share gb common="--routing trained --streams --decode-reps 1 --decode-tokens 64 --prefill ${RAM_PREFILL:-4096} \
		--prefill-reps 1 --repeat none --ckpt-root $CKPT_ROOT --out-dir $dir"
	for share in ${RAM_SHARES:-100 50 25}; do
		if [ "$share" = 100 ]; then
			step compare-ram-100 200 python3 -m bench.compare $common --arms stock-vram,exact --arm-timeout 120 \
				--budget-s 190 --name compare-ram-100
			continue
		fi
		[ -n "${ckpt:-}" ] || ckpt=$(python3 -m bench.ram_tier_decode --checkpoint "$CKPT_ROOT" | tail -1)
		[ -e "$dir/disk-bw.json" ] || [ -n "${RAM_NO_DISK_BW:-}" ] || step disk-bw 60 python3 bench/disk_bw.py --file "$CKPT_ROOT/disk_bw.scratch" \
			--experts 48 --depths 1,4,16 --reps 2 --out "$dir/disk-bw.json"
		gb=$(python3 -m bench.ram_tier_decode --budget-gb "$ckpt" "$share")
		step "compare-ram-$share" 230 python3 -m bench.compare $common --arms exact --project-args "--host-ram-gb $gb" \
			--arm-timeout 220 --budget-s 225 --name "compare-ram-$share"
	done
	step ram-tier-report 30 python3 -m bench.ram_tier_decode --report "$dir" --out "$dir/ram-tier.json"
	cat "$dir/ram-tier.json" 2>/dev/null
}

ram-tier-reader() {  # issue 32: the disk reader's shared pieces. disk_bw with decode's pattern at several piece sizes;
	# full RAM (stock-vram for the bound's T_fix) and 50 % at prefill RAM_PREFILL (the report against the bound); then at
	# 50 % and prefill 512 the default pieces against 4096 KiB (one pread a projection: the reader before), A/B/A
	local ckpt gb run args common="--routing trained --streams --decode-reps 1 --decode-tokens 64 --prefill-reps 1 --repeat none \
		--ckpt-root $CKPT_ROOT --out-dir $dir"
	ckpt=$(python3 -m bench.ram_tier_decode --checkpoint "$CKPT_ROOT" | tail -1)
	step disk-bw 150 python3 bench/disk_bw.py --file "$CKPT_ROOT/disk_bw.scratch" --experts 48 --depths 1,4,8,16 --reps 2 \
		--decode-pieces-kb 4096,1024,512,256 --decode-per-submit 1,2,4 --out "$dir/disk-bw.json"
	gb=$(python3 -m bench.ram_tier_decode --budget-gb "$ckpt" 50)
	step compare-ram-100 200 python3 -m bench.compare $common --prefill "${RAM_PREFILL:-4096}" --arms stock-vram,exact \
		--arm-timeout 120 --budget-s 190 --name compare-ram-100
	step compare-ram-50 230 python3 -m bench.compare $common --prefill "${RAM_PREFILL:-4096}" --arms exact \
		--project-args "--host-ram-gb $gb" --arm-timeout 220 --budget-s 225 --name compare-ram-50
	step ram-tier-report 30 python3 -m bench.ram_tier_decode --report "$dir" --out "$dir/ram-tier.json"
	for run in new-1 old new-2; do
		args="--host-ram-gb $gb"
		[ "$run" = old ] && args="$args --disk-piece-kb 4096"
		step "compare-ram-pieces-$run" 175 python3 -m bench.compare $common --prefill 512 --arms exact --project-args "$args" \
			--arm-timeout 160 --budget-s 170 --name "compare-ram-pieces-$run"
	done
	step ram-pieces-report 30 python3 -m bench.ram_tier_decode --policy-runs "$dir"/compare-ram-pieces-{new-1,old,new-2}.json \
		--out "$dir/ram-pieces-ab.json"
	cat "$dir/ram-tier.json" "$dir/ram-pieces-ab.json" 2>/dev/null
}

ab_at_half_ram() {  # ab_at_half_ram NAME "ARGS" RUN...: exact mode at 50 % RAM on `trained`, prefill 512, one
	# bench.compare a run in order, with ARGS (the run "none": without), then their report ($dir/NAME-ab.json)
	local name=$1 on_args=$2 ckpt gb run args
	shift 2
	ckpt=$(python3 -m bench.ram_tier_decode --checkpoint "$CKPT_ROOT" | tail -1)
	gb=$(python3 -m bench.ram_tier_decode --budget-gb "$ckpt" 50)
	for run in "$@"; do
		args="--host-ram-gb $gb"
		[ "$run" = none ] || args="$args $on_args"
		step "compare-$name-$run" 175 python3 -m bench.compare --routing trained --arms exact --project-args "$args" \
			--streams --decode-reps 1 --decode-tokens 64 --prefill 512 --prefill-reps 1 --repeat none --arm-timeout 160 \
			--budget-s 170 --ckpt-root "$CKPT_ROOT" --out-dir "$dir" --name "compare-$name-$run"
	done
	step "$name-report" 30 python3 -m bench.ram_tier_decode --policy-runs "$dir"/compare-"$name"-*.json --out "$dir/$name-ab.json"
	cat "$dir/$name-ab.json" 2>/dev/null
}

ram-tier-ahead() {  # issue 32: reads ahead (GLM53_RAM_TIER_READ_AHEAD=RAM_AHEAD, default 2) against none at 50 % RAM;
	# AHEAD_RUNS: the runs in order (default ahead-1 none ahead-2, an A/B/A)
	ab_at_half_ram ram-ahead "--ram-tier-read-ahead ${RAM_AHEAD:-2}" ${AHEAD_RUNS:-ahead-1 none ahead-2}
}

ram-tier-write-back() {  # issue 32: the VRAM cache's evictions written back into RAM slots (GLM53_RAM_TIER_WRITE_BACK)
	# against none at 50 % RAM; WRITE_BACK_RUNS: the runs in order (default back-1 none back-2, an A/B/A)
	ab_at_half_ram ram-write-back "--ram-tier-write-back 1" ${WRITE_BACK_RUNS:-back-1 none back-2}
}

ram-tier-fast() {  # fast mode at 50 % RAM, its CPU tier beside the RAM tier (reading experts in the tier's arena),
	# against exact mode at 50 % RAM: RAM_FAST_RUNS in order (default fast-1 exact fast-2, an A/B/A), prefill RAM_PREFILL
	# (default 512, so that decode dominates; 4096 measures fast mode's one-pass prefill)
	local ckpt gb run
	ckpt=$(python3 -m bench.ram_tier_decode --checkpoint "$CKPT_ROOT" | tail -1)
	gb=$(python3 -m bench.ram_tier_decode --budget-gb "$ckpt" 50)
	for run in ${RAM_FAST_RUNS:-fast-1 exact fast-2}; do
		step "compare-ram-fast-$run" 175 python3 -m bench.compare --routing trained --arms "${run%-*}" \
			--project-args "--host-ram-gb $gb" --streams --decode-reps 1 --decode-tokens 64 --prefill "${RAM_PREFILL:-512}" \
			--prefill-reps 1 --repeat none --arm-timeout 160 --budget-s 170 --ckpt-root "$CKPT_ROOT" --out-dir "$dir" \
			--name "compare-ram-fast-$run"
	done
	step ram-fast-report 30 python3 -m bench.ram_tier_decode --policy-runs "$dir"/compare-ram-fast-*.json --out "$dir/ram-fast-ab.json"
	cat "$dir/ram-fast-ab.json" 2>/dev/null
}

ram-policy-ab() {  # the RAM tier's policy's share of a difference at 50 % RAM: the same code, the old policy's settings
	# (RAM_POLICY_OLD_ARGS: --ram-tier-* flags; default the tier's first policy). Prefill 512 so that decode dominates;
	# a run takes ~100 s on the H200, each is capped at 175 s so that the phase (with the checkpoint's scan) stays in ~560 s
	local ckpt gb run args
	ckpt=$(python3 -m bench.ram_tier_decode --checkpoint "$CKPT_ROOT" | tail -1)
	gb=$(python3 -m bench.ram_tier_decode --budget-gb "$ckpt" 50)
	for run in new-1 old new-2; do
		args="--host-ram-gb $gb"
		[ "$run" = old ] && args="$args ${RAM_POLICY_OLD_ARGS:---ram-tier-decay 0.999 --ram-tier-hysteresis 1.25 --ram-tier-recency-weight 0 --ram-tier-vram-score 0 --ram-tier-exclusive 0}"
		step "compare-ram-policy-$run" 175 python3 -m bench.compare --routing trained --arms exact --project-args "$args" \
			--streams --decode-reps 1 --decode-tokens 64 --prefill 512 --prefill-reps 1 --repeat none --arm-timeout 160 \
			--budget-s 170 --ckpt-root "$CKPT_ROOT" --out-dir "$dir" --name "compare-ram-policy-$run"
	done
	step ram-policy-report 30 python3 -m bench.ram_tier_decode --policy-runs "$dir"/compare-ram-policy-{new-1,old,new-2}.json \
		--out "$dir/ram-policy-ab.json"
	cat "$dir/ram-policy-ab.json" 2>/dev/null
}

cpu-tier-ring() {  # the CPU tier's handoff: the host producer's and the kernel's tests on this host's CPUs, then the GPU producer's twice
	step cpu-worker-tests 150 python3 -m pytest -q -p no:cacheprovider tests/cpu_tier/test_worker.py tests/cpu_tier/test_kernel.py
	local run
	for run in 1 2; do
		step "gpu-ring-tests-$run" 150 python3 -m pytest -v -rA -p no:cacheprovider tests/gpu/test_cpu_tier_device.py
	done
}

run_phases "$@"
