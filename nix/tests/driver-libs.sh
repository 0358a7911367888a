#!/usr/bin/env bash
# Golden test of nix/ci/driver-libs.sh (the classifier behind checks.no-libcuda), run by nix/ci/check.sh in its
# golden tier: fixture trees shaped like the store paths it meets, classified, against
# nix/tests/golden/driver-libs.txt.
#
#   nix/tests/driver-libs.sh            compare
#   nix/tests/driver-libs.sh --update   rewrite the golden file
#
# The fixtures, one directory each, named like the store paths they stand for:
#   cudart        nixpkgs' cuda_cudart with one output: lib/stubs/libcuda.so.1 -> libcuda.so
#   cudart-stubs  cuda_cudart's separate stubs output: lib/stubs/libcuda.so.1 and lib/libcuda.so.1 -> stubs/...
#   nvml-dev      cuda_nvml_dev's stub lib/stubs/libnvidia-ml.so.1, a file
#   nvidia-x11    a driver: lib/libcuda.so.1 -> libcuda.so.580.95.05, lib/libnvidia-ml.so.1 a file
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
golden=$REPO/nix/tests/golden/driver-libs.txt
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cd "$work"
mkdir -p cudart/lib/stubs cudart-stubs/lib/stubs nvml-dev/lib/stubs nvidia-x11/lib
touch cudart/lib/stubs/libcuda.so cudart-stubs/lib/stubs/libcuda.so nvml-dev/lib/stubs/libnvidia-ml.so.1 \
	nvidia-x11/lib/libcuda.so.580.95.05 nvidia-x11/lib/libnvidia-ml.so.1
ln -s libcuda.so cudart/lib/stubs/libcuda.so.1
ln -s libcuda.so cudart-stubs/lib/stubs/libcuda.so.1
ln -s stubs/libcuda.so.1 cudart-stubs/lib/libcuda.so.1
ln -s libcuda.so.580.95.05 nvidia-x11/lib/libcuda.so.1

# One case per line of output: its name, the exit status and the classifier's lines.
run_case() {
	local name=$1 rc=0 out
	shift
	out=$(bash "$REPO/nix/ci/driver-libs.sh" "$@") || rc=$?
	printf '== %s: exit %s\n%s\n' "$name" "$rc" "$out"
}
got=$(
	run_case "stubs only (the servers' closure as it should be)" cudart cudart-stubs nvml-dev
	run_case "a driver among the stubs" cudart nvidia-x11 nvml-dev
)

if [ "${1:-}" = --update ]; then
	printf '%s\n' "$got" >"$golden"
	echo "wrote ${golden#"$REPO"/}"
	exit 0
fi
if ! diff -u "$golden" <(printf '%s\n' "$got"); then
	echo "nix/ci/driver-libs.sh: output differs from ${golden#"$REPO"/} (nix/tests/driver-libs.sh --update rewrites it)" >&2
	exit 1
fi
