#!/usr/bin/env bash
# The offline Nix checks, run by `make test` on every submission. Need no network but PyPI's and Debian's, and no Nix
# binary cache:
#
#   1 parse   every .nix file of the repository parses
#   2 lock    flake.lock: one nixpkgs node at the revision of nix/pins/nixpkgs.nix, a well-formed narHash, and
#             Nix itself finds the lock up to date with flake.nix
#   3 golden  the project's Nix logic (nix/lib: systemd unit for both modes, OCI image config, wrapper flags, pins
#             to SRI hashes, CUDA arch list) against nix/tests/golden/*.json, and the no-libcuda check's classifier
#             (nix/ci/driver-libs.sh) on fixtures against nix/tests/golden/driver-libs.txt
#   4 pins    pyproject.toml still asks for what nix/pins/pypi.json pins, and every pinned PyPI file is fetched
#             through Nix's fixed-output fetcher and matched against its hash
#   5 eval    the flake evaluated against an offline nixpkgs tree close to the pin (NIXPKGS_EVAL_FILE below): every
#             package's, check's and release build's derivation, the NixOS configurations (the appliance and its disk
#             image, services.glm53 with every option set, the VM test's node) with their assertions, and no warning
#             but those the project raises on purpose (nix/ci/eval.nix, nix/ci/eval_warnings.py); nothing is built
#   6 wheels  a dry run of autoPatchelf: every library each ELF file of the native wheels needs (NEEDED) is provided
#             by the wheel, the build inputs the eval tier found, glibc, or is the driver's and left to the host; and
#             the two run-time loaders the packages patch (cuda-bindings' through cuda.pathfinder, Triton's libcuda
#             lookup) find what they load (nix/ci/wheel_deps.py)
#
# Which Nix runs them: a `nix` of version 2.18 or later on PATH, as it is. Otherwise, as root on Debian, Nix 2.26
# from Debian trixie in a chroot made by mmdebstrap and cached outside the repository (NIXCI_CHROOT, default
# $XDG_CACHE_HOME/glm53/nix-trixie or /var/cache/glm53/nix-trixie; delete it to start afresh). On any other machine
# the tier does not run and says why. With CI=true it must run: anything that keeps it from running fails the run,
# the eval tier's nixpkgs tree missing included.
# Measured on a 2-core Debian 12 machine shared with other work: tiers 1 to 4 about 40 s without the cache (chroot
# ~20 s, ~1 GB of wheels ~17 s), 1 s with it; eval 80 s without it (Nix unpacks the tree into its store) and 40 s
# with it, all evaluation; wheels 15 s either way (it decompresses the ELF files it reads).
#
#   nix/ci/check.sh                   run the tiers
#   nix/ci/check.sh --update-golden   rewrite nix/tests/golden/*.json from nix/tests/golden.nix (review the diff)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MIN_NIX=2.18 # nixpkgs' own minimum (lib/minfeatures.nix)
CHROOT_NIX=2.26
DEBIAN_SUITE=trixie
# This script's own variables start with NIXCI_, not GLM53_: glm53 refuses unknown GLM53_* variables, so one
# exported for this script would stop a `glm53 serve` started from the same shell.
DEBIAN_MIRROR=${NIXCI_DEBIAN_MIRROR:-http://deb.debian.org/debian}
CHROOT_PACKAGES=nix-bin,ca-certificates
# Offline by design: no substituters, no build users (the chroot runs as root, in no sandbox of its own).
CHROOT_NIX_CONF='build-users-group =
experimental-features = nix-command flakes
substituters =
sandbox = false
max-jobs = 8
'
HOST_CA=${NIX_SSL_CERT_FILE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
# The nixpkgs tree the eval tier evaluates the flake against: nixpkgs master of 2026-07-15, three months before the pin
# (../shared/nixpkgs-eval/README.md says what it is and the two evaluation-only stubs it carries). At 33 MB it is not
# in the repository: NIXCI_NIXPKGS_EVAL names the tarball, else it is taken from ../shared/nixpkgs-eval/ beside the
# checkout or /work/shared/nixpkgs-eval/.
NIXPKGS_EVAL_FILE=nixpkgs-2026-07-15-eval.tar.xz
# The NAR hash of the unpacked tree, which Nix checks: it copies the tree into its store once, and on later runs
# only unpacks the tarball into its tarball cache again (about 5 s) to lock the input.
NIXPKGS_EVAL_NARHASH=sha256-sQbZi17TSQvNuuWtczjAT7jMT6uAT8fOpOLWQ9H88Nc=

case "${CI:-}" in true | 1) in_ci=1 ;; *) in_ci=0 ;; esac
update_golden=0
case "${1:-}" in
"") ;;
--update-golden) update_golden=1 ;;
*)
	echo "usage: $0 [--update-golden]" >&2
	exit 2
	;;
esac

say() { printf 'nix checks: %s\n' "$*"; }

# The tier cannot run here. Outside CI that is said plainly and `make test` goes on; in CI it is a failure.
not_run() {
	if ((in_ci)); then
		say "FAILED: the Nix tier must run in CI but cannot: $*" >&2
		exit 1
	fi
	say "NOT RUN: $*" >&2
	say "NOT RUN: the Nix checks (nix/ci/check.sh) were skipped; nothing about flake.nix, flake.lock, nix/ or the PyPI pins was checked" >&2
	exit 0
}

version_at_least() { [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]; }

# --- Nix on PATH -------------------------------------------------------------------------------------------------
host_nix_version() {
	command -v nix >/dev/null 2>&1 || return 1
	nix --version 2>/dev/null | grep -Eo '[0-9]+\.[0-9]+(\.[0-9]+)?' | head -n1
}

# --- Nix in a cached Debian trixie chroot ------------------------------------------------------------------------
chroot_cache() {
	if [ -n "${NIXCI_CHROOT:-}" ]; then
		echo "$NIXCI_CHROOT"
	elif [ -n "${XDG_CACHE_HOME:-}" ]; then
		echo "$XDG_CACHE_HOME/glm53/nix-$DEBIAN_SUITE"
	else
		echo "/var/cache/glm53/nix-$DEBIAN_SUITE"
	fi
}

# What the chroot is built from; a cache made from anything else is rebuilt.
chroot_recipe() {
	printf 'suite=%s\nmirror=%s\npackages=%s\n%s' "$DEBIAN_SUITE" "$DEBIAN_MIRROR" "$CHROOT_PACKAGES" "$CHROOT_NIX_CONF"
}

# Runs "$@" in the chroot, in the repository (mounted read-only at /src), with the host's resolver and CA bundle
# (this project's registries are reached through a proxy whose CA only the host trusts). The mounts live in a
# private mount namespace and vanish with it.
in_chroot() {
	local root=$1
	shift
	# shellcheck disable=SC2016 # the script is expanded by the inner sh, from its arguments
	unshare --mount --propagation private --fork -- sh -euc '
		root=$1 repo=$2 ca=$3
		shift 3
		mount -t proc proc "$root/proc"
		mount --rbind /dev "$root/dev"
		mkdir -p "$root/src"
		mount --bind "$repo" "$root/src"
		mount -o remount,bind,ro "$root/src"
		touch "$root/etc/resolv.conf" "$root/etc/ssl/certs/host-ca.crt"
		mount --bind /etc/resolv.conf "$root/etc/resolv.conf"
		mount --bind "$ca" "$root/etc/ssl/certs/host-ca.crt"
		exec chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/bin:/bin LANG=C.UTF-8 \
			NIX_SSL_CERT_FILE=/etc/ssl/certs/host-ca.crt sh -c "cd /src && exec \"\$@\"" sh "$@"
	' sh "$root" "$REPO" "$HOST_CA" "$@"
}

# Makes sure a working chroot is in the cache; prints why not and returns 1 if it cannot.
ensure_chroot() {
	local cache root started
	cache=$(chroot_cache)
	root=$cache/root
	mkdir -p "$cache" || {
		echo "cannot create the chroot cache $cache"
		return 1
	}
	# One run at a time builds or replaces the chroot.
	exec 9>"$cache/lock"
	flock 9
	if [ -x "$root/usr/bin/nix" ] && [ "$(cat "$cache/recipe" 2>/dev/null)" = "$(chroot_recipe)" ]; then
		return 0
	fi
	started=$(date +%s)
	say "building the Debian $DEBIAN_SUITE chroot with Nix $CHROOT_NIX in $cache (once per machine)" >&2
	if ! command -v mmdebstrap >/dev/null 2>&1; then
		say "installing mmdebstrap with apt-get" >&2
		if ! { apt-get install -y -qq mmdebstrap >/dev/null 2>&1 ||
			{ apt-get update -qq >/dev/null && apt-get install -y -qq mmdebstrap >/dev/null; }; }; then
			echo "apt-get could not install mmdebstrap (no Debian mirror reachable?)"
			return 1
		fi
	fi
	rm -rf "$cache/root.new"
	if ! mmdebstrap --quiet --variant=apt --include="$CHROOT_PACKAGES" "$DEBIAN_SUITE" "$cache/root.new" \
		"$DEBIAN_MIRROR" >"$cache/mmdebstrap.log" 2>&1; then
		echo "mmdebstrap failed (log: $cache/mmdebstrap.log): $(tail -n 3 "$cache/mmdebstrap.log" | tr '\n' ' ')"
		return 1
	fi
	mkdir -p "$cache/root.new/etc/nix"
	printf '%s' "$CHROOT_NIX_CONF" >"$cache/root.new/etc/nix/nix.conf"
	local version
	if ! version=$(in_chroot "$cache/root.new" nix --version); then
		echo "Nix does not run in the new chroot (unshare or chroot refused?)"
		return 1
	fi
	case "$version" in
	*" $CHROOT_NIX".*) ;;
	*)
		echo "the chroot has $version; expected $CHROOT_NIX.x from Debian $DEBIAN_SUITE"
		return 1
		;;
	esac
	rm -rf "$root" "$cache/recipe"
	mv "$cache/root.new" "$root"
	chroot_recipe >"$cache/recipe"
	say "chroot ready in $(($(date +%s) - started)) s: $version" >&2
}

# --- the eval tier's nixpkgs tree ----------------------------------------------------------------------------------
# Prints the tarball's path, or why there is none and returns 1 (none found) or 2 (NIXCI_NIXPKGS_EVAL names no file).
nixpkgs_eval_tarball() {
	if [ -n "${NIXCI_NIXPKGS_EVAL:-}" ]; then
		if [ -f "$NIXCI_NIXPKGS_EVAL" ]; then
			realpath "$NIXCI_NIXPKGS_EVAL"
			return 0
		fi
		echo "NIXCI_NIXPKGS_EVAL=$NIXCI_NIXPKGS_EVAL is not a file"
		return 2
	fi
	local dir
	for dir in "$REPO/../shared/nixpkgs-eval" /work/shared/nixpkgs-eval; do
		if [ -f "$dir/$NIXPKGS_EVAL_FILE" ]; then
			realpath "$dir/$NIXPKGS_EVAL_FILE"
			return 0
		fi
	done
	echo "$NIXPKGS_EVAL_FILE is in neither $(realpath -m "$REPO/../shared/nixpkgs-eval") nor /work/shared/nixpkgs-eval (NIXCI_NIXPKGS_EVAL=PATH names it)"
	return 1
}

# --- choose the Nix ----------------------------------------------------------------------------------------------
if version=$(host_nix_version) && version_at_least "$version" "$MIN_NIX"; then
	run() { (cd "$REPO" && NIX_CONFIG="extra-experimental-features = nix-command flakes" "$@"); }
	chroot_root=""
	say "using nix $version from PATH"
else
	have=${version:+nix $version on PATH is older than $MIN_NIX}
	have=${have:-no nix on PATH}
	if [ "$(id -u)" != 0 ]; then
		not_run "$have, and only root can build the Debian chroot with Nix $CHROOT_NIX (run as root, or install Nix >= $MIN_NIX)"
	fi
	if [ ! -f /etc/debian_version ] || ! command -v apt-get >/dev/null 2>&1; then
		not_run "$have, and this is not a Debian system, where the Nix $CHROOT_NIX chroot is made with mmdebstrap"
	fi
	for tool in unshare flock chroot; do
		command -v "$tool" >/dev/null 2>&1 || not_run "$have, and $tool is missing"
	done
	if ! why=$(ensure_chroot); then
		not_run "$have, and the Nix $CHROOT_NIX chroot could not be made: $why"
	fi
	chroot_root=$(chroot_cache)/root
	run() { in_chroot "$chroot_root" "$@"; }
	say "using $(run nix --version) in the chroot $(chroot_cache)"
fi

# --- the tiers ---------------------------------------------------------------------------------------------------
failed=0
tier_start=0
begin() {
	tier_start=$(date +%s%N)
	printf 'nix checks: %-7s ' "$1"
}
pass() { printf 'ok (%s ms) %s\n' "$((($(date +%s%N) - tier_start) / 1000000))" "$*"; }
fail() {
	printf 'FAILED\n'
	printf '%s\n' "$@" | sed 's/^/    /' >&2
	failed=1
}

if ((update_golden)); then
	for name in $(run nix eval --raw --file nix/tests/golden.nix names --apply 'builtins.concatStringsSep " "'); do
		out=$REPO/nix/tests/golden/$name.json
		json=$(run nix eval --json --file nix/tests/golden.nix "cases.$name")
		if command -v python3 >/dev/null 2>&1; then
			printf '%s' "$json" | python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin), indent=2, sort_keys=True))' >"$out"
		else
			printf '%s\n' "$json" >"$out"
		fi
		echo "wrote ${out#"$REPO"/}"
	done
	"$REPO/nix/tests/driver-libs.sh" --update
	exit 0
fi

# 1. parse
begin parse
if command -v git >/dev/null 2>&1 && git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
	mapfile -t nix_files < <(git -C "$REPO" ls-files --cached --others --exclude-standard -- '*.nix')
else
	mapfile -t nix_files < <(cd "$REPO" && find . -name '*.nix' -not -path './.git/*' -not -path './.venv/*' | sed 's|^\./||')
fi
if out=$(run sh -c 'for f; do nix-instantiate --parse "$f" >/dev/null || exit 1; done' sh "${nix_files[@]}" 2>&1); then
	pass "${#nix_files[@]} files"
else
	fail "$out"
fi

# 2. lock
begin lock
if out=$(run nix eval --raw --file nix/ci/lock.nix 2>&1) &&
	out2=$(run sh -c 'd=$(mktemp -d) && cp flake.nix flake.lock "$d" &&
		nix flake metadata --no-update-lock-file --no-write-lock-file --json "path:$d" >/dev/null' 2>&1); then
	pass "$out"
else
	fail "$out" "${out2:-}"
fi

# 3. golden, and every GLM53_* variable the Nix side sets is one glm53/config.py knows (the server refuses an
# unknown one at start, so a renamed setting would otherwise surface only on a deployed machine)
begin golden
settings=$(grep -Eho 'GLM53_[A-Z0-9_]+' "$REPO"/nix/lib/*.nix "$REPO"/nix/module.nix "$REPO"/appliance/*.nix | sort -u)
if command -v python3 >/dev/null 2>&1; then
	unknown=$(printf '%s\n' "$settings" | python3 -c '
import importlib.util, sys
spec = importlib.util.spec_from_file_location("glm53_config", sys.argv[1])
config = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = config  # dataclasses looks the module up by name
spec.loader.exec_module(config)
known = config._ENV_NAMES | config.FOREIGN_ENV
print(" ".join(name for name in sys.stdin.read().split() if name not in known))
' "$REPO/glm53/config.py")
	settings_note="$(printf '%s\n' "$settings" | wc -l) GLM53_* names known to glm53/config.py"
else
	unknown=""
	settings_note="GLM53_* names not compared with glm53/config.py: no python3"
fi
if ! out=$(run nix eval --raw --file nix/tests/golden.nix failures --apply 'builtins.concatStringsSep "\n"' 2>&1) ||
	[ -n "$out" ]; then
	fail "$out"
elif ! out=$("$REPO/nix/tests/driver-libs.sh" 2>&1); then
	fail "$out"
elif [ -n "$unknown" ]; then
	fail "set by the Nix files but not a setting of glm53/config.py: $unknown"
else
	pass "$(run nix eval --raw --file nix/tests/golden.nix names --apply 'n: toString (builtins.length n)') cases and the driver-library fixtures; $settings_note"
fi

# Outputs of one tier that a later one reads.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# 4. pins
begin pins
fetched=0
if ! out=$(run nix eval --raw --file nix/ci/pins.nix requirements 2>&1); then
	fail "$out"
elif ! ((in_ci)) && command -v curl >/dev/null 2>&1 &&
	! curl --silent --head --max-time 10 --output /dev/null https://files.pythonhosted.org/; then
	printf 'NOT RUN (files.pythonhosted.org unreachable; %s)\n' "$out"
	say "NOT RUN: the PyPI pins were not fetched; their hashes are unchecked" >&2
elif run nix-build --no-out-link --quiet nix/ci/pins.nix -A fetch >"$work/wheels" 2>"$work/fetch.err"; then
	fetched=1
	pass "$out, all fetched and matching"
else
	fail "$(tail -n 20 "$work/fetch.err")"
fi

# 5. eval: the flake evaluated against the offline nixpkgs tree, as `nix eval --override-input nixpkgs` would: every
# output's derivation (nothing is built), the NixOS configurations' assertions and warnings (nix/ci/eval.nix), and
# no warning printed that the project does not raise on purpose (nix/ci/eval_warnings.py)
begin eval
evaluated=0
if tarball=$(nixpkgs_eval_tarball); then found=0; else found=$?; fi
if ((found)); then
	# The tree is a workplace file beside the checkout, which no registry serves: a CI machine without it cannot
	# fetch it, so there the tier says loudly that it did not run instead of failing every submission; a tarball
	# named by NIXCI_NIXPKGS_EVAL that is not there is a mistake and fails
	if ((found == 2)); then
		fail "the eval tier cannot run: $tarball"
	else
		printf 'NOT RUN (%s)\n' "$tarball"
		say "NOT RUN: the flake was not evaluated against nixpkgs; no derivation, module or warning was checked" >&2
	fi
elif ! command -v python3 >/dev/null 2>&1 || ! git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1; then
	fail "the eval tier needs python3 and a git checkout (git names the flake's files)"
else
	# Nix reads the tarball where it runs: the chroot sees a copy in its own cache.
	if [ -n "$chroot_root" ]; then
		mkdir -p "$chroot_root/var/cache/glm53"
		cmp -s "$tarball" "$chroot_root/var/cache/glm53/$NIXPKGS_EVAL_FILE" ||
			cp "$tarball" "$chroot_root/var/cache/glm53/$NIXPKGS_EVAL_FILE"
		tree_url=file:///var/cache/glm53/$NIXPKGS_EVAL_FILE
	else
		tree_url=file://$tarball
	fi
	tree_url="tarball+$tree_url?narHash=$(printf '%s' "$NIXPKGS_EVAL_NARHASH" | sed 's/+/%2B/g; s|/|%2F|g; s/=/%3D/g')"
	# The flake as `nix build` would see it (git's files, tracked or not ignored), copied where Nix runs, with its
	# lock pointed at the tree: the evaluation then prints nothing about the override.
	mapfile -t src_files < <(cd "$REPO" && git ls-files --cached --others --exclude-standard | while IFS= read -r f; do
		[ -e "$f" ] && printf '%s\n' "$f"
	done)
	nix_flags=(--offline --option flake-registry "" --accept-flake-config)
	if ! src=$(run sh -c 'd=$(mktemp -d /tmp/glm53-eval.XXXXXX) && cp --parents -t "$d" -- "$@" && echo "$d"' sh "${src_files[@]}" 2>&1); then
		fail "could not copy the flake's files: $src"
	elif ! out=$(run nix flake lock "${nix_flags[@]}" --override-input nixpkgs "$tree_url" "path:$src" 2>&1); then
		fail "nix flake lock --override-input nixpkgs $tree_url:" "$out"
	# --read-only: the derivations' paths are computed as always but not written to the store, where writing a few
	# thousand .drv files took minutes on a busy disk; no evaluation cache, so that every run prints its warnings.
	elif ! run nix eval "${nix_flags[@]}" --read-only --option eval-cache false --json "path:$src#." \
		--apply "$(<"$REPO/nix/ci/eval.nix")" >"$work/eval.json" 2>"$work/eval.err"; then
		fail "$(tail -n 40 "$work/eval.err")"
	elif ! out=$(python3 "$REPO/nix/ci/eval_warnings.py" "$work/eval.json" "$work/eval.err" 2>&1); then
		fail "$out"
	else
		evaluated=1
		pass "$out"
	fi
	if [[ ${src:-} == /tmp/glm53-eval.* ]]; then run rm -rf "$src"; fi
fi

# 6. wheels: a dry run of autoPatchelf over the wheels the pins tier fetched, with what the eval tier found the
# derivations give it, and of the two run-time loaders the packages patch (nix/ci/wheel_deps.py)
begin wheels
if ((evaluated && fetched)); then
	if out=$(python3 "$REPO/nix/ci/wheel_deps.py" "$work/eval.json" "$work/wheels" "$chroot_root" 2>&1); then
		pass "$out"
	else
		fail "$out"
	fi
else
	printf 'NOT RUN (it reads what the pins and eval tiers fetched and evaluated)\n'
	say "NOT RUN: no wheel was checked for the libraries it needs" >&2
fi

if ((failed)); then
	say "FAILED" >&2
	exit 1
fi
say "all passed"
