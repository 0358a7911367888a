# Sourced by the serve-fast / serve-exact wrappers (nix/pkgs/serve.nix), which then call glm53_host_driver: makes the
# host's NVIDIA driver libraries, and nothing else of the host, visible to the programs of the Nix closure.
#
# Those programs read neither the host's ld.so.cache nor /usr/lib: on NixOS their RUNPATH names
# /run/opengl-driver/lib, on Ubuntu, Fedora or Arch nothing finds libcuda.so.1. Putting the host's library directory on
# LD_LIBRARY_PATH would also put its libc and libstdc++ in front of the closure's, so the driver's own libraries
# (libcuda*, libnvidia-*: libcuda.so.1, libnvidia-ml.so.1 and what they load themselves, such as
# libnvidia-ptxjitcompiler) are linked into a directory of their own under the cache directory, and only that one goes
# on LD_LIBRARY_PATH. torch, Triton's libcuda lookup and cuda-bindings load the driver from there.
#
#   glm53_host_driver NAME [ROOT]   NAME: the program, for messages; ROOT: prefix of every host path (tests)
#
# Where libcuda.so.1 and libnvidia-ml.so.1 are looked for, the first directory holding each wins: $GLM53_DRIVER_DIR,
# /run/opengl-driver/lib (NixOS), the host's ldconfig cache (ldconfig -p), then /usr/lib/x86_64-linux-gnu (Debian,
# Ubuntu), /usr/lib64 (Fedora, RHEL, openSUSE), /usr/lib (Arch), /usr/lib/wsl/lib (WSL) and /usr/local/nvidia/lib64
# (the NVIDIA container toolkit). Finding neither is said, naming every place looked at, and the server still starts:
# the CPU demo engine needs no GPU, and the exl3 engine's preflight refuses with its own message.
#
# Bash builtins and the coreutils named by store path only: in the OCI image and under systemd nothing else is on PATH.

glm53_driver_usual_dirs=(/usr/lib/x86_64-linux-gnu /usr/lib64 /usr/lib /usr/lib/wsl/lib /usr/local/nvidia/lib64)
glm53_driver_ldconfigs=(/sbin/ldconfig /usr/sbin/ldconfig /usr/bin/ldconfig)

# Sets REPLY to the directory that holds SONAME, or returns 1; glm53_driver_looked lists the places looked at.
glm53_driver_find() {
	local root=$1 soname=$2 dir ldconfig="" candidate lib arch arrow path
	glm53_driver_looked=()
	for dir in ${GLM53_DRIVER_DIR:+"$GLM53_DRIVER_DIR"} /run/opengl-driver/lib; do
		glm53_driver_looked+=("$dir")
		REPLY=$root$dir
		[ -e "$REPLY/$soname" ] && return 0
	done
	for candidate in "${glm53_driver_ldconfigs[@]}"; do
		if [ -x "$root$candidate" ]; then
			ldconfig=$candidate
			break
		fi
	done
	if [ -n "$ldconfig" ]; then
		glm53_driver_looked+=("the cache of $ldconfig")
		# "<TAB>libcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1"; 32-bit builds are listed too
		while read -r lib arch arrow path; do
			if [ "$lib" = "$soname" ] && [[ $arch == *x86-64* ]] && [ -e "$root$path" ]; then
				REPLY=$root${path%/*}
				return 0
			fi
		done < <("$root$ldconfig" -p 2>/dev/null)
	fi
	for dir in "${glm53_driver_usual_dirs[@]}"; do
		glm53_driver_looked+=("$dir")
		REPLY=$root$dir
		[ -e "$REPLY/$soname" ] && return 0
	done
	return 1
}

glm53_host_driver() {
	local name=$1 root=${2:-} cuda="" ml="" looked key dir link file src
	local -A sources=()
	if glm53_driver_find "$root" libnvidia-ml.so.1; then ml=$REPLY; fi
	if glm53_driver_find "$root" libcuda.so.1; then cuda=$REPLY; fi
	if [ -z "$cuda" ] && [ -z "$ml" ]; then
		looked=$(printf ', %s' "${glm53_driver_looked[@]}")
		echo "$name: no NVIDIA driver found: neither libcuda.so.1 nor libnvidia-ml.so.1 is in ${looked#, }." \
			"Only the CPU demo engine (--engine tiny) can run. Install the NVIDIA driver, or set GLM53_DRIVER_DIR to the" \
			"directory that holds libcuda.so.1." >&2
		return 0
	fi
	[ -n "$cuda" ] || echo "$name: libcuda.so.1 not found (libnvidia-ml.so.1 is in $ml): the GPU engine cannot start" >&2
	[ -n "$ml" ] || echo "$name: libnvidia-ml.so.1 not found (libcuda.so.1 is in $cuda): GPU monitoring fails" >&2
	[ -z "$cuda" ] || sources[$cuda]=1
	[ -z "$ml" ] || sources[$ml]=1

	# One directory per driver location, filled in place: a running server loads from it long after it started (the
	# driver's JIT compiler on first use), so a later start must not replace it.
	key=${cuda:-$ml}
	dir=${XDG_CACHE_HOME:-${HOME:-/nonexistent}/.cache}/glm53/host-driver/${key//[^A-Za-z0-9._-]/_}
	if ! @coreutils@/bin/mkdir -p "$dir" 2>/dev/null; then
		dir=$(@coreutils@/bin/mktemp -d "${TMPDIR:-/tmp}/glm53-host-driver.XXXXXX")
	fi
	for link in "$dir"/*; do
		[ -e "$link" ] || @coreutils@/bin/rm -f -- "$link"
	done
	for src in "${!sources[@]}"; do
		for file in "$src"/libcuda.so* "$src"/libcudadebugger.so* "$src"/libnvidia-*.so*; do
			[ -e "$file" ] && @coreutils@/bin/ln -sfn -- "$file" "$dir/${file##*/}"
		done
	done
	echo "$name: the NVIDIA driver's libraries of ${!sources[*]}, through $dir" >&2
	export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}
