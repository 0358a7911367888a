#!/usr/bin/env bash
# Run the GPU suite on a GPU machine from a clean copy of the repository, and write a short report.
#
#   tests/gpu/run.sh [pytest arguments]
#
# GPU_KIT: a copy of ../shared/device (wheels, prebuilt exllamav3 extension, Triton cache, prep.sh); default .gpu
# REPORT_DIR: where the report (and the figures some tests write) goes; default $OUT (the device runner's output
#   folder) or /tmp/glm53-gpu-report
# TEST_CHECKPOINT: where the tiny synthetic checkpoint is written; default /tmp/glm53-ckpt/tiny
# SCALED_CHECKPOINT: unset by default; set, the exactness tests also run on the scaled checkpoint written there
#   (the device's 64 GB disk holds one 36 GB copy: after bench/compare.py, name its /tmp/glm53-compare/scaled-*)
set -uo pipefail
cd "$(dirname "$0")/../.."
KIT=${GPU_KIT:-.gpu}
# exported: tests write their figures there too (test_reliability_exl3.py: reliability-exl3.json and .md)
export REPORT_DIR=${REPORT_DIR:-${OUT:-/tmp/glm53-gpu-report}}
export TEST_CHECKPOINT=${TEST_CHECKPOINT:-/tmp/glm53-ckpt/tiny}
export SERVER_LOG_DIR=${SERVER_LOG_DIR:-$REPORT_DIR}
mkdir -p "$REPORT_DIR"
now() { echo $(( $(date +%s%N) / 1000000 )); }  # milliseconds

t0=$(now)
# shellcheck disable=SC1091
source "$KIT/prep.sh" || { echo "run.sh: $KIT/prep.sh failed" >&2; exit 2; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Triton kernels for the tiny checkpoint's shapes, saved from an earlier run (else ~100 s of compiling here)
if [ -e "$KIT/triton-cache-tiny.tgz" ]; then tar xzf "$KIT/triton-cache-tiny.tgz" -C "$TRITON_CACHE_DIR"; fi
t1=$(now)
python3 -m glm53 synth --preset tiny --out "$TEST_CHECKPOINT" --seed 1 --force || exit 2
# SCALED_CHECKPOINT: also test on the layer-scaled real-shape checkpoint (36 GB; written here once, ~30 s)
if [ -n "${SCALED_CHECKPOINT:-}" ] && [ ! -e "$SCALED_CHECKPOINT/config.json" ]; then
  python3 -m glm53 synth --preset scaled --out "$SCALED_CHECKPOINT" --seed 1 --force || exit 2
fi
t2=$(now)
python3 -m pytest tests/gpu -v -rA -p no:cacheprovider --junitxml "$REPORT_DIR/gpu-junit.xml" "$@" 2>&1 | tee "$REPORT_DIR/gpu-pytest.log"
rc=${PIPESTATUS[0]}
t3=$(now)

{
  echo "# GPU test report"
  echo
  echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "- gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
  echo "- cpu: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  python3 -c 'import sys, torch; from exllamav3.version import __version__ as v; print(f"- python {sys.version.split()[0]}, torch {torch.__version__}, exllamav3 {v}")' 2>/dev/null
  echo "- prep (wheels, extension): $(( (t1 - t0) / 1000 )) s; synth tiny checkpoint: $(( (t2 - t1) / 1000 )) s; pytest: $(( (t3 - t2) / 1000 )) s"
  echo "- result: $(tail -1 "$REPORT_DIR/gpu-pytest.log")"
} > "$REPORT_DIR/gpu-report.md"
cat "$REPORT_DIR/gpu-report.md"
exit "$rc"
