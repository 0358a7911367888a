#!/usr/bin/env bash
# The release gate: everything nix/ci/check.sh cannot do offline. Needs a Linux x86_64 machine with Nix (flakes
# enabled) and network to GitHub and the binary caches, KVM for the NixOS VM test and the disk image, Docker for the
# image, and optionally an NVIDIA GPU with a driver of the 595 series or newer (580 with limits). First run: hours
# (exllamav3's CUDA kernels for every configured capability dominate; README, "Build cost"); later runs reuse the
# store.
#
#   nix/ci/release-check.sh 2>&1 | tee release-check.log
#
# Every step prints what it proves, each command it runs ("$ ...") and how long it took, and the run ends with the
# time of every step, so that a run on a networked builder can be reported step by step with its cost; the first
# failure stops the run and names the step and the command. The steps (the builds are the flake's hydraJobs):
#   1 nix flake check (every output evaluates; the evaluation checks build)
#   2 the servers' closure
#   3 serve-fast with the CPU demo engine
#   4 the OCI image under Docker
#   5 the appliance: toplevel, raw-efi disk image and the NixOS VM test of the unit
#   6 with a GPU: the exl3 engine on a synthetic checkpoint
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

port=30871
current="setup"
started=$(date +%s)
costs=()

# The time the current step took, printed and kept for the summary.
end_step() {
	local took=$(($(date +%s) - started))
	printf '(step %s: %s s)\n' "$current" "$took"
	costs+=("$(printf '%6s s  step %s' "$took" "$current")")
}
step() { # NUMBER TITLE PROOF...: a step's heading and what it proves
	[ "$current" = setup ] || end_step
	current="$1 $2"
	started=$(date +%s)
	printf '\n== step %s: %s\n' "$1" "$2"
	shift 2
	printf 'proves: %s\n' "$1"
	shift
	printf '        %s\n' "$@"
}
run() { # COMMAND...: print it, then run it
	printf '$ %s\n' "$*" >&2
	"$@"
}
nix_build() { run nix build --no-link --print-out-paths -L "$@"; }
# What to stop or remove when the run ends, set by the steps that start a server or a container.
cleanup=:
on_exit() {
	local status=$?
	eval "$cleanup"
	if [ "$status" != 0 ]; then
		end_step
		printf '\nFAILED in step %s (exit %s): the last command printed above\n' "$current" "$status" >&2
	fi
	printf '\n== time per step\n'
	printf '%s\n' "${costs[@]}"
}
trap on_exit EXIT

wait_healthy() { # URL PID: until the URL answers 200, or fail when PID has exited
	printf '$ (poll %s for 200, up to 3 minutes)\n' "$1" >&2
	for _ in $(seq 1 180); do
		if curl --silent --fail --output /dev/null --max-time 5 "$1"; then return 0; fi
		kill -0 "$2" 2>/dev/null || {
			echo "the server exited before $1 answered" >&2
			return 1
		}
		sleep 1
	done
	echo "$1 did not answer 200 within 3 minutes" >&2
	return 1
}

step 1 "nix flake check" \
	"nixpkgs is fetched at the locked revision and its narHash is the one in flake.lock (Nix refuses a mismatch);" \
	"every output evaluates against the pinned nixpkgs (packages, apps, the NixOS module, the appliance, the release" \
	"builds of hydraJobs), including torch.nix's assertion that cudaPackages_13_2's builds are ones" \
	"nix/pins/torch-cuda.json shows to satisfy torch; the evaluation checks build: the golden tests," \
	"appliance-mounts (the disk image's evaluated fileSystems hold the weights partition) and module-options (every" \
	"option of services.glm53 reaches the unit)"
run nix flake check -L

step 2 "the servers' closure" \
	"both servers build (torch's import check loads every CUDA library it NEEDs, binding all their symbols), and" \
	"no-libcuda: no driver library in their closure, stubs allowed; torch reports CUDA 13.2 and takes each CUDA" \
	"library from where nix/lib/torch-cuda.nix says; triton, exllamav3 and exllamav3_ext import; exllamav3_ext and" \
	"glm53's expert-cache library hold machine code for exactly the configured capabilities; glm53 loads its CPU" \
	"kernels from the package"
nix_build .#hydraJobs.serve-fast.x86_64-linux .#hydraJobs.serve-exact.x86_64-linux .#hydraJobs.no-libcuda.x86_64-linux
run nix eval --json ".#torch.cudaLibraries"
env=$(nix_build ".#serve-fast.env")
printf '$ %s\n' "$env/bin/python -c 'import torch, triton, exllamav3_ext, exllamav3, glm53; ...'" >&2
"$env/bin/python" - <<'EOF'
import torch, triton, exllamav3_ext, exllamav3, glm53
assert torch.version.cuda == "13.2", torch.version.cuda
print("torch", torch.__version__, "CUDA", torch.version.cuda, "triton", triton.__version__)
EOF
expected=$(run nix eval --raw ".#exllamav3.ext.torchCudaArchList")
mapfile -t cuobjdump_outputs < <(nix_build ".#exllamav3.ext.cudaPackages.cuda_cuobjdump^*")
cuobjdump=$(find "${cuobjdump_outputs[@]}" -name cuobjdump -type f | head -n1)
# the machine code (SASS) in a library, as a sorted list of sm_ names
machine_code() { "$cuobjdump" --list-elf "$1" | grep -Eo 'sm_[0-9]+[af]?' | sort -uV | tr '\n' ' '; }
want=$(tr ';' '\n' <<<"$expected" | sed 's/\.//; s/^/sm_/' | sort -uV | tr '\n' ' ')
for lib in "$(find "$env/" -name 'exllamav3_ext*.so' | head -n1)" "$(find "$env/" -path '*/glm53/_native/libglm53_ec_*.so' | head -n1)"; do
	printf '$ cuobjdump --list-elf %s\n' "$lib" >&2
	found=$(machine_code "$lib")
	[ "$found" = "$want" ] || {
		echo "$lib holds machine code for $found; the configured capabilities are $want" >&2
		exit 1
	}
	echo "$(basename "$lib"): $found"
done
printf '$ %s\n' "$env/bin/python -c 'from glm53.cpu_tier import kernel as cpu_expert; ...'" >&2
"$env/bin/python" - <<'EOF'
from glm53.cpu_tier import kernel as cpu_expert
print("glm53 CPU tier:", cpu_expert.locate(), "ISAs", ", ".join(cpu_expert.available_isas()))
EOF

step 3 "serve-fast with the CPU demo engine" \
	"the packaged server starts from its wrapper and answers /health and /v1/models (OpenAI model list)"
serve=$(nix_build ".#serve-fast")
printf '$ %s\n' "$serve/bin/serve-fast --engine tiny --port $port &" >&2
"$serve/bin/serve-fast" --engine tiny --port "$port" &
server=$!
cleanup='kill "$server" 2>/dev/null || true'
wait_healthy "http://127.0.0.1:$port/health" "$server"
run curl --silent --fail "http://127.0.0.1:$port/v1/models" | grep -q '"glm-5.3-flash"'
kill "$server"
wait "$server" || true
cleanup=:

step 4 "the OCI image" \
	"the streamed image loads into Docker, and the server in it starts and answers /v1/models"
image=$(nix_build .#hydraJobs.oci-fast.x86_64-linux)
printf '$ %s | docker load\n' "$image" >&2
"$image" | docker load
container=glm53-release-check-$$
run docker run --detach --rm --name "$container" --publish "127.0.0.1:$port:30000" glm53:fast --engine tiny >/dev/null
cleanup='docker rm --force "$container" >/dev/null 2>&1 || true'
printf '$ (poll http://127.0.0.1:%s/health, up to 2 minutes)\n' "$port" >&2
for _ in $(seq 1 120); do
	curl --silent --fail --output /dev/null "http://127.0.0.1:$port/health" && break
	sleep 1
done
run curl --silent --fail "http://127.0.0.1:$port/v1/models" | grep -q '"glm-5.3-flash"'
run docker rm --force "$container" >/dev/null
cleanup=:

step 5 "the appliance" \
	"the appliance's NixOS system (driver, service, SSH, file systems) and its raw-efi disk image build (the" \
	"image's build VM needs KVM); the NixOS VM test: the unit turns active once /health answers, serves the OpenAI" \
	"API with the CPU demo engine and keeps its hardening"
nix_build .#hydraJobs.appliance.x86_64-linux
nix_build .#hydraJobs.appliance-image.x86_64-linux
nix_build .#hydraJobs.vm.x86_64-linux

step 6 "the exl3 engine on a GPU" \
	"on this machine's GPU and driver: preflight passes, serve-exact loads a synthetic checkpoint (real shapes and" \
	"EXL3 format) through exllamav3 and torch's CUDA libraries, and answers a chat request"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --list-gpus >/dev/null 2>&1; then
	run nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv
	work=$(mktemp -d)
	exact=$(nix_build ".#serve-exact")
	# an installed glm53 has no default routing profile (glm53/tools/synth/writer.py): the checkout's is given
	run "$env/bin/glm53" synth --preset tiny --out "$work/model" --profile glm53/models/glm53-flash-routing-profile.json
	printf '$ %s\n' "$exact/bin/serve-exact --engine exl3 -m $work/model --root $work/state --port $port &" >&2
	"$exact/bin/serve-exact" --engine exl3 -m "$work/model" --root "$work/state" --port "$port" &
	server=$!
	cleanup='kill "$server" 2>/dev/null || true; rm -rf "$work"'
	wait_healthy "http://127.0.0.1:$port/health" "$server"
	run curl --silent --fail "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
		-d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}' | grep -q '"finish_reason"'
	kill "$server"
	wait "$server" || true
	cleanup=:
else
	echo "skipped: no NVIDIA GPU on this machine; run the release check on a GPU host before a release"
fi

end_step
current=done
printf '\n== release checks passed\n'
