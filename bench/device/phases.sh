# Sourced by the device-run scripts (bench/run_*.sh): a step runner that logs and never stops its phase, and the
# phase dispatcher that records the machine and packs each phase's results into $OUT/<phase>.tgz (the device sends
# back a few files only). The sourcing script defines PHASES and one shell function per phase, then calls
# `run_phases "$@"`; each phase writes into "$dir".
set -uo pipefail
OUT=${OUT:-/tmp/glm53-device-out}
KIT=${GPU_KIT:-.gpu}
CKPT_ROOT=${CKPT_ROOT:-/tmp/glm53-compare}
# a 24 GB card's share of the scaled checkpoint (32 of 288 experts a layer in VRAM), as every earlier run
CARD="--ec-cache-experts 384 --vram-limit-gb 15.4"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS CMD...: runs CMD with a time limit, logs it, never stops the phase
	local name=$1 limit=$2
	shift 2
	echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"
	local t0=$SECONDS
	timeout --signal=INT --kill-after=20 "$limit" "$@" >"$dir/$name.log" 2>&1
	local rc=$?
	echo "=== $name: exit $rc after $((SECONDS - t0)) s"
	tail -n 25 "$dir/$name.log"
	return 0
}

run_phase() {
	dir=$WORK/$1
	mkdir -p "$dir" "$OUT"
	{
		echo "phase $1: $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
		nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
		echo "$(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
	} | tee "$dir/machine.txt"
	"$1"
	tar czf "$OUT/$1.tgz" -C "$WORK" "$1" && echo "packed $OUT/$1.tgz ($(du -h "$OUT/$1.tgz" | cut -f1))"
}

run_phases() {
	[ $# -gt 0 ] || { echo "usage: $0 PHASE... (of: $PHASES; or all)" >&2; exit 2; }
	# shellcheck disable=SC1091
	[ -n "${GLM53_SITE:-}" ] || source "$KIT/prep.sh"
	[ "$*" = all ] && set -- $PHASES
	for phase in "$@"; do
		case " $PHASES " in
		*" $phase "*) run_phase "$phase" ;;
		*) echo "unknown phase $phase (of: $PHASES)" >&2 ;;
		esac
	done
}
