#!/usr/bin/env bash
# The NVIDIA driver's user-space libraries (libcuda.so.1, libnvidia-ml.so.1) under the directories given, one per
# line as "driver PATH" or "stub PATH", sorted; exits 1 when any is a driver library. checks.no-libcuda runs it over
# the servers' closure, nix/tests/driver-libs.sh over fixtures.
#
# A driver library must come from the machine the server runs on, never from the store. A link-time stub may be in
# the closure: nixpkgs' cuda_cudart (and cuda_nvml_dev) install NVIDIA's stubs in lib/stubs, and the stubs come
# along with the package that torch's RUNPATH names. Two layouts occur across nixpkgs revisions: a single output
# holding lib/stubs/libcuda.so.1 (a link to lib/stubs/libcuda.so), and a separate stubs output that also links
# lib/libcuda.so.1 to stubs/libcuda.so.1. So a file is a stub when it, or what it resolves to, lies in a lib/stubs
# directory.
#
#   nix/ci/driver-libs.sh DIR...
set -euo pipefail
export LC_ALL=C # one sort order on every machine: the golden test compares the output

status=0
while IFS= read -r -d '' lib; do
	target=$(readlink -f -- "$lib")
	case "$lib" in
	*/lib/stubs/*) kind=stub ;;
	*) case "$target" in
		*/lib/stubs/*) kind=stub ;;
		*) kind=driver status=1 ;;
		esac ;;
	esac
	printf '%s %s\n' "$kind" "$lib"
done < <(find "$@" \( -name libcuda.so.1 -o -name libnvidia-ml.so.1 \) -print0 | sort -z)
exit "$status"
