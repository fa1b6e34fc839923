# Two commands for a fresh clone:  `make demo` runs the whole recipe on the embedded default, `make test` tests.
# Each creates .venv when missing and installs what it needs (the CPU build of torch first where there is no GPU);
# `make test` also installs Chromium (the browser tests) and bubblewrap (the code reward's sandbox) where it may.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CORE   := $(VENV)/.installed-core
DEV    := $(VENV)/.installed-dev
# the versions the tests last passed with: every install takes them, so a library's new release cannot change a
# fresh clone unseen; `make lock` moves them to the newest that pyproject.toml allows, and tests them
LOCK   := constraints.txt

.PHONY: demo test install lock browser sandbox clean

demo: $(CORE)
	$(VENV)/bin/r1 run --recipe tiny

# `auto` is bf16 on a CPU with avx512_bf16 or amx_bf16 and fp32 elsewhere, and CI runs on either kind: the tests
# marked `precision` (those that train under `auto` or are about it) run again with the CPU's answer turned round
# (R1_CPU_BF16), so no verdict depends on which kind CI got
OTHER_BF16 := $(shell grep -qwsE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo 0 || echo 1)

# Two test files at a time (pytest-xdist; a file's tests stay together, so its module fixtures are made once): the
# suite's servers, clusters and subprocesses spend much of their time waiting, and two workers fill the 2 cores.
# Files go out in the order tests/conftest.py puts them (the longest first), not xdist's (the most tests first)
TESTS := -n 2 --dist loadfile --no-loadscope-reorder

test: $(DEV) browser sandbox
	$(PY) -m pytest -q $(TESTS) --durations=15
	R1_CPU_BF16=$(OTHER_BF16) $(PY) -m pytest -q $(TESTS) -m precision

install: $(DEV)

# the demo needs the package alone; the tests also need the dev extra (TRL, a Ray cluster, peft, bitsandbytes)
# CONSTRAIN is empty for `make lock`, which installs the newest allowed versions to write the lock from
CONSTRAIN ?= -c $(LOCK)
TORCH = $(shell grep -s '^torch==' $(LOCK) || echo torch)

$(CORE): pyproject.toml $(LOCK)
	@echo "installing into $(VENV): torch, transformers, Prefect, MLflow and the rest (a few minutes on a new machine)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "GPU found: installing torch from the default index"; \
	else \
		echo "no GPU: installing the CPU build of torch first"; \
		$(PY) -m pip install -q $(CONSTRAIN) '$(TORCH)'; \
	fi
	@echo "installing the project and its libraries"
	$(PY) -m pip install -q $(CONSTRAIN) -e .
	touch $(CORE)

$(DEV): $(CORE)
	@echo "installing what the tests also need (TRL, Ray, peft, bitsandbytes, selenium)"
	$(PY) -m pip install -q $(CONSTRAIN) -e '.[dev]'
	touch $(DEV)

# A fresh .venv with the newest versions pyproject.toml allows, written to the lock (local build labels such as
# torch's +cpu dropped, so one lock serves CPU and GPU machines: `torch==X` takes X+cpu or X+cu128), then the tests.
# Commit the new constraints.txt once they pass. torch stays at its locked version (pip keeps an installed
# requirement that is satisfied): its CPU and CUDA builds come from different indexes, so it moves by editing its
# line here, then `make lock`.
lock:
	rm -rf $(VENV)
	$(MAKE) $(DEV) CONSTRAIN=
	{ echo "# The versions the tests passed with (make lock writes this file; every make install takes it)."; \
	  $(PY) -m pip freeze --exclude-editable | grep -v ' @ ' | sed -E 's/\+[A-Za-z0-9.]+$$//'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	touch $(CORE) $(DEV)
	$(MAKE) test

# tests/e2e/test_ui.py drives the Prefect and MLflow UIs in Debian's Chromium: installed where we may (root with
# apt-get, as in CI), else the test is skipped saying how to get it. A failed install stops CI here (CI set),
# where the test would fail anyway; elsewhere it only warns.
browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Chromium and its driver for tests/e2e/test_ui.py (apt-get)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		{ apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; } || { \
			echo "could not install chromium chromium-driver: tests/e2e/test_ui.py cannot run"; [ -z "$$CI" ]; }; \
	else \
		echo "tests/e2e/test_ui.py needs Chromium and its driver, skipped without them:" \
			"apt-get install -y chromium chromium-driver"; \
	fi

# The code reward runs programs only inside bubblewrap (Debian's bubblewrap package), and its tests
# (tests/grpo/rewards/test_sandbox.py, tests/grpo/rewards/test_code_reward.py) need it: installed where we may, as for
# Chromium; else those tests are skipped saying how to get it, or fail in CI. The demo's recipe has no code reward:
# `demo` skips it.
sandbox:
	@if command -v bwrap >/dev/null 2>&1; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing bubblewrap for the code reward's sandbox (apt-get)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		{ apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; } || { \
			echo "could not install bubblewrap: the code reward cannot run here"; [ -z "$$CI" ]; }; \
	else \
		echo "the code reward and its tests need bubblewrap, skipped without it: apt-get install -y bubblewrap"; \
	fi

clean:
	rm -rf .r1
