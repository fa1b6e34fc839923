# Two commands for a fresh clone:  `make demo` runs the whole recipe on the embedded default, `make test` tests.
# Each creates .venv when missing and installs what it needs (the CPU build of torch first where there is no GPU).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test install clean

demo: $(STAMP)
	$(VENV)/bin/r1 run --recipe tiny

test: $(STAMP)
	$(PY) -m pytest -q

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then \
		echo "GPU found: installing torch from the default index"; \
	else \
		echo "no GPU: installing the CPU build of torch first"; \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

clean:
	rm -rf .r1
