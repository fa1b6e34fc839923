# Two commands for a fresh clone:  `make demo` runs the whole recipe on the embedded default, `make test` tests.
# Each creates .venv when missing and installs what it needs (the CPU build of torch first where there is no GPU).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CORE   := $(VENV)/.installed-core
DEV    := $(VENV)/.installed-dev

.PHONY: demo test install clean

demo: $(CORE)
	$(VENV)/bin/r1 run --recipe tiny

test: $(DEV)
	$(PY) -m pytest -q

install: $(DEV)

# the demo needs the package alone; the tests also need the dev extra (TRL, a Ray cluster, peft, bitsandbytes)
$(CORE): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "GPU found: installing torch from the default index"; \
	else \
		echo "no GPU: installing the CPU build of torch first"; \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e .
	touch $(CORE)

$(DEV): $(CORE)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(DEV)

clean:
	rm -rf .r1
