#!/usr/bin/env bash
# The release gate: everything nix/ci/check.sh cannot do offline. Needs a Linux x86_64 machine with Nix (flakes
# enabled) and network to GitHub and the binary caches, KVM for the NixOS VM test, Docker for the image, and
# optionally an NVIDIA GPU with the 580 driver or newer. First run: hours (exllamav3's CUDA kernels for every
# configured capability dominate); later runs reuse the store.
#
#   nix/ci/release-check.sh
#
# Steps, each of which stops the run when it fails:
#   1 nix flake check: fetches nixpkgs (confirming the narHash of flake.lock), evaluates every output, builds the
#     checks: both servers, the golden tests, the no-libcuda closure check, the NixOS VM test of the service
#   2 the servers' closure: torch reports CUDA 13.2, triton and exllamav3_ext import, exllamav3_ext and glm53's
#     expert-cache library hold machine code for exactly the configured capabilities, and glm53 loads its CPU
#     kernels from the package
#   3 serve-fast with the CPU demo engine answers /health and /v1/models
#   4 the OCI image loads into Docker and serves the demo engine
#   5 the appliance: its system toplevel and its raw-efi disk image build
#   6 with a GPU: a synthetic checkpoint served by the exl3 engine from serve-exact answers a chat request
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

port=30871
step() { printf '\n== %s\n' "$*"; }
nix_build() { nix build --no-link --print-out-paths -L "$@"; }

wait_healthy() { # URL PID: until the URL answers 200, or fail when PID has exited
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

step "1 nix flake check"
nix flake check -L

step "2 the servers' closure"
env=$(nix_build ".#serve-fast.env")
"$env/bin/python" - <<'EOF'
import torch, triton, exllamav3_ext, exllamav3, glm53
assert torch.version.cuda == "13.2", torch.version.cuda
print("torch", torch.__version__, "CUDA", torch.version.cuda, "triton", triton.__version__)
EOF
expected=$(nix eval --raw ".#exllamav3.ext.torchCudaArchList")
mapfile -t cuobjdump_outputs < <(nix_build ".#exllamav3.ext.cudaPackages.cuda_cuobjdump^*")
cuobjdump=$(find "${cuobjdump_outputs[@]}" -name cuobjdump -type f | head -n1)
# the machine code (SASS) in a library, as a sorted list of sm_ names
machine_code() { "$cuobjdump" --list-elf "$1" | grep -Eo 'sm_[0-9]+[af]?' | sort -uV | tr '\n' ' '; }
want=$(tr ';' '\n' <<<"$expected" | sed 's/\.//; s/^/sm_/' | sort -uV | tr '\n' ' ')
for lib in "$(find "$env/" -name 'exllamav3_ext*.so' | head -n1)" "$(find "$env/" -path '*/glm53/_native/libglm53_ec_*.so' | head -n1)"; do
	found=$(machine_code "$lib")
	[ "$found" = "$want" ] || {
		echo "$lib holds machine code for $found; the configured capabilities are $want" >&2
		exit 1
	}
	echo "$(basename "$lib"): $found"
done
"$env/bin/python" - <<'EOF'
from glm53.offload import cpu_expert
print("glm53 CPU tier:", cpu_expert.locate(), "ISAs", ", ".join(cpu_expert.available_isas()))
EOF

step "3 serve-fast with the CPU demo engine"
serve=$(nix_build ".#serve-fast")
"$serve/bin/serve-fast" --engine tiny --port "$port" &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
wait_healthy "http://127.0.0.1:$port/health" "$server"
curl --silent --fail "http://127.0.0.1:$port/v1/models" | grep -q '"glm-5.3-flash"'
kill "$server"
wait "$server" || true
trap - EXIT

step "4 the OCI image"
"$(nix_build ".#oci-fast")" | docker load
container=glm53-release-check-$$
docker run --detach --rm --name "$container" --publish "127.0.0.1:$port:30000" glm53:fast --engine tiny >/dev/null
trap 'docker rm --force "$container" >/dev/null 2>&1 || true' EXIT
for _ in $(seq 1 120); do
	curl --silent --fail --output /dev/null "http://127.0.0.1:$port/health" && break
	sleep 1
done
curl --silent --fail "http://127.0.0.1:$port/v1/models" | grep -q '"glm-5.3-flash"'
docker rm --force "$container" >/dev/null
trap - EXIT

step "5 the appliance"
nix_build ".#nixosConfigurations.appliance.config.system.build.toplevel"
nix_build ".#appliance-image"

step "6 the exl3 engine on a GPU"
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --list-gpus >/dev/null 2>&1; then
	work=$(mktemp -d)
	exact=$(nix_build ".#serve-exact")
	# an installed glm53 has no default routing profile (glm53/models/synth/writer.py): the checkout's is given
	"$env/bin/glm53" synth --preset tiny --out "$work/model" --profile reference/glm53-flash-routing-profile.json
	"$exact/bin/serve-exact" --engine exl3 -m "$work/model" --root "$work/state" --port "$port" &
	server=$!
	trap 'kill "$server" 2>/dev/null || true; rm -rf "$work"' EXIT
	wait_healthy "http://127.0.0.1:$port/health" "$server"
	curl --silent --fail "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
		-d '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}' | grep -q '"finish_reason"'
	kill "$server"
	wait "$server" || true
else
	echo "skipped: no NVIDIA GPU on this machine; run the release check on a GPU host before a release"
fi

step "release checks passed"
