# Slipway: `make demo` runs the pipeline end to end; `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine (Python, pip, npm, apt).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements.lock 2>/dev/null | sha1sum | cut -c1-12)
DATA ?= data
OUT ?= out

.PHONY: install corpora demo test lint format bench clean

$(STAMP): pyproject.toml requirements.lock
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip uv
	$(UV) pip sync --python $(PY) requirements.lock
	$(UV) pip install --python $(PY) --no-deps -e .
	@# Byte-compile once: with PYTHONDONTWRITEBYTECODE set, every Beam worker process would
	@# otherwise recompile apache_beam from source (5-9 s each).
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	@rm -f $(VENV)/.installed-* && touch $@

install: $(STAMP)

# Pin every dependency so a fresh machine installs exactly what CI tested.
requirements.lock: pyproject.toml
	@test -x $(UV) || ($(PYTHON) -m venv $(VENV) && $(PY) -m pip install --quiet uv)
	$(UV) pip compile --python $(PY) --extra dev --extra gcp --universal --quiet -o $@ pyproject.toml

corpora: install
	$(PY) -m pipelines.corpora.fetch --data-dir $(DATA)

demo: install
	$(PY) -m pipelines.demo --data-dir $(DATA) --output $(OUT)/demo

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pytest

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install
	@for b in tests/bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(OUT) .pytest_cache .ruff_cache
