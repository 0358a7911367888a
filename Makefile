# Every target makes its own virtual environment and installs what it needs: on a fresh machine
# `make demo` serves and `make test` passes with no other step.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# A CPU build of torch is enough for the demo model and the CPU tests; pinned so that pip does not fetch a
# multi-GB CUDA build (pip takes this version from a local wheel where one is provided, as on CI).
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed-serve-dev-hub-fleet
# The agent CLIs that tests/server/test_agent_clis.py drives, pinned; each npm package brings its native binary.
CLAUDE_CODE := 2.1.332
CODEX_CLI   := 0.171.0
NPM_TOOLS   := .npm-tools
NPM_STAMP   := $(NPM_TOOLS)/.installed-claude-$(CLAUDE_CODE)-codex-$(CODEX_CLI)

# exllamav3's own source, for the CPU tests that check the patch points against it (tests/engine/exl3); the version
# pyproject.toml's gpu extra pins, as PyPI serves it (the wheel carries the Python and CUDA sources; nothing is built)
EXLLAMAV3 := $(shell sed -n 's/.*"exllamav3==\([^"]*\)".*/\1/p' pyproject.toml)
EXLLAMAV3_WHEEL := $(VENV)/wheels/exllamav3-$(EXLLAMAV3)-py3-none-any.whl

.PHONY: demo test test-nix native bindings agent-clis exllamav3-source readme clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet "$(TORCH)"
	$(BIN)/pip install --quiet -e '.[serve,dev,hub,fleet]'
	touch $(STAMP)

# ARGS is appended to the server's command line (make demo ARGS="--port 38123"): the last value of a flag wins.
demo: $(STAMP)
	$(BIN)/glm53 serve $(ARGS)

# The offline Nix checks run beside the CPU suite (nix/ci/check.sh holds about one core and the suite waits on its
# servers most of the time: together they take the longer of the two, not their sum) and print their report after it;
# either failing fails the target.
# The environment, the native library and the agent CLIs are set up side by side (pip and npm wait on downloads while
# g++ compiles).
test:
	@$(MAKE) --no-print-directory -j3 $(STAMP) native agent-clis
	@$(MAKE) --no-print-directory exllamav3-source
	@nix/ci/check.sh > $(VENV)/nix-checks.log 2>&1 & checks=$$!; \
	$(BIN)/python -m pytest -q -m 'not gpu' --durations=15; tests=$$?; \
	wait $$checks; nix=$$?; cat $(VENV)/nix-checks.log; \
	[ $$tests -eq 0 ] && [ $$nix -eq 0 ]

exllamav3-source: $(EXLLAMAV3_WHEEL)

$(EXLLAMAV3_WHEEL): $(STAMP)
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: -d $(VENV)/wheels "exllamav3==$(EXLLAMAV3)"

agent-clis: $(NPM_STAMP)

$(NPM_STAMP):
	rm -rf $(NPM_TOOLS)
	npm install --prefix $(NPM_TOOLS) --no-save --no-package-lock --no-audit --no-fund --loglevel=error \
		@anthropic-ai/claude-code@$(CLAUDE_CODE) @openai/codex@$(CODEX_CLI)
	touch $@

# The CPU tier's kernel library, native/build/libglm53_cpu_expert.so (g++; tests/cpu_tier/test_kernel.py checks it).
native:
	$(MAKE) -C native -j$$(nproc)

# The native libraries' ctypes bindings (glm53/native/*_binding.py) and ABI tables (native/**/*_abi.inc), generated
# from their headers by glm53/native/bindgen.py (standard library only); run it after changing a header and commit
# what it writes (tests/native/test_bindgen.py fails while they are out of step).
bindings:
	python3 -m glm53.native.bindgen

# The offline Nix checks (flake.lock, golden tests of nix/lib, PyPI pins, the flake evaluated against the offline
# nixpkgs tree of ../shared/nixpkgs-eval, a dry run of autoPatchelf over the wheels). They use a Nix >= 2.18 on PATH,
# else (as root on Debian) a cached trixie chroot with Nix 2.26; elsewhere they say they did not run, and with
# CI=true that fails the run.
test-nix:
	nix/ci/check.sh

readme: $(STAMP)
	$(BIN)/python -c "import pathlib, glm53.config as c; p = pathlib.Path('README.md'); p.write_text(c.readme_with_table(p.read_text()))"

clean:
	rm -rf $(VENV) $(NPM_TOOLS) .pytest_cache .hypothesis build native/build *.egg-info
