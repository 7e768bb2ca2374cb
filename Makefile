# Slipway: `make demo` runs the pipeline end to end; `make test` runs the tests.
# Both create .venv and install what they need on a fresh machine (Python, pip, npm, apt).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml requirements.lock 2>/dev/null | sha1sum | cut -c1-12)
PARITY_STAMP := $(VENV)/.parity-$(shell cat pyproject.toml requirements.lock requirements-parity.txt 2>/dev/null | sha1sum | cut -c1-12)
DATA ?= data
OUT ?= out

.PHONY: install install-parity lock corpora browser demo demo-data sweep-demo airflow test lint format bench bench-pytorch torch-venv datatrove-venv clean

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip uv
	@echo "installing requirements.lock into $(VENV) (uv pip sync)"
	$(UV) pip sync --quiet --python $(PY) requirements.lock
	$(UV) pip install --quiet --python $(PY) --no-deps -e .
	@# Byte-compile once: with PYTHONDONTWRITEBYTECODE set, every Beam worker process would
	@# otherwise recompile apache_beam from source (5-9 s each).
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	@# the sync removed what the lock does not pin, the parity references among them
	@rm -f $(VENV)/.installed-* $(VENV)/.parity-* && touch $@

install: $(STAMP)

# The parity tests' references (torch, transformers, lm-eval; requirements-parity.txt), for
# `make test` only: pip, constrained by the lock so that nothing the lock pins moves.
$(PARITY_STAMP): $(STAMP)
	@echo "installing requirements-parity.txt into $(VENV) (the parity tests' references)"
	$(PY) -m pip install --quiet -c requirements.lock -r requirements-parity.txt
	@rm -f $(VENV)/.parity-* && touch $@

install-parity: $(PARITY_STAMP)

# Pin every dependency so a fresh machine installs exactly what CI tested. Run `make lock`
# after changing dependencies in pyproject.toml (never implicitly: git checkouts give files
# arbitrary mtimes, and an unplanned re-resolve would change what CI tests).
lock:
	@test -x $(UV) || ($(PYTHON) -m venv $(VENV) && $(PY) -m pip install --quiet uv)
	$(UV) pip compile --python $(PY) --extra dev --extra gcp --universal --quiet -o requirements.lock pyproject.toml

corpora: install
	$(PY) -m pipelines.corpora.fetch --data-dir $(DATA)

# The pipeline DAG end to end with `airflow dags test` (no scheduler needed): its own Airflow
# home and SQLite DB under $(OUT)/airflow, the step outputs and lineage DB under $(OUT), then a
# summary from lineage. A second `make demo` is all cache hits.
AIRFLOW_ENV = AIRFLOW_HOME="$(abspath $(OUT))/airflow" \
	AIRFLOW__CORE__DAGS_FOLDER="$(CURDIR)/dags" \
	AIRFLOW__CORE__PLUGINS_FOLDER="$(CURDIR)/plugins" \
	AIRFLOW__CORE__LOAD_EXAMPLES=False \
	SLIPWAY_HOME="$(abspath $(OUT))" \
	SLIPWAY_DATA_DIR="$(abspath $(DATA))"
AIRFLOW_PORT ?= 8080
# The task-log servers (the UI reads task logs from them) move with the UI's port, so that two
# `make airflow` on one machine do not collide: Airflow's own 8793 and 8794 beside 8080.
AIRFLOW_LOG_PORT ?= $(shell echo $$(( $(AIRFLOW_PORT) + 713 )))
AIRFLOW_TRIGGER_LOG_PORT ?= $(shell echo $$(( $(AIRFLOW_PORT) + 714 )))

demo: install corpora
	@mkdir -p $(OUT)/airflow
	@$(AIRFLOW_ENV) $(VENV)/bin/airflow db migrate > $(OUT)/airflow/migrate.log 2>&1 \
		|| (tail -20 $(OUT)/airflow/migrate.log; exit 1)
	@echo "airflow dags test slipway_pipeline (log: $(OUT)/demo.log; follow it with: tail -f $(OUT)/demo.log)"
	@start=$$(date +%s); \
	$(AIRFLOW_ENV) $(VENV)/bin/airflow dags test slipway_pipeline > $(OUT)/demo.log 2>&1; \
	status=$$?; echo "DAG run took $$(( $$(date +%s) - start )) s (exit $$status)"; \
	$(AIRFLOW_ENV) $(PY) -m operators.summary; \
	if [ $$status -ne 0 ]; then tail -40 $(OUT)/demo.log; exit $$status; fi

# The scaling sweep's defaults with `airflow dags test` (docs/scaling.md): the data plane
# (cache hits after `make demo`, but the sweep's own 1024-token vocabulary), an IsoFLOP grid
# of 15 cells over three budgets, both fits, a forecast at 10x pre-registered, trained and
# checked. The same home as `make demo`; a second `make sweep-demo` is all cache hits.
sweep-demo: install corpora
	@mkdir -p $(OUT)/airflow
	@$(AIRFLOW_ENV) $(VENV)/bin/airflow db migrate > $(OUT)/airflow/migrate.log 2>&1 \
		|| (tail -20 $(OUT)/airflow/migrate.log; exit 1)
	@echo "airflow dags test slipway_scaling_sweep (log: $(OUT)/sweep-demo.log; follow it with: tail -f $(OUT)/sweep-demo.log)"
	@start=$$(date +%s); \
	$(AIRFLOW_ENV) $(VENV)/bin/airflow dags test slipway_scaling_sweep > $(OUT)/sweep-demo.log 2>&1; \
	status=$$?; echo "DAG run took $$(( $$(date +%s) - start )) s (exit $$status)"; \
	$(AIRFLOW_ENV) $(VENV)/bin/slipway sweep show latest; \
	if [ $$status -ne 0 ]; then tail -40 $(OUT)/sweep-demo.log; exit $$status; fi

# The data plane alone, without Airflow: the pipeline graph walked up to the token stores
# (operators/pipeline/dataplane.py), outputs under $(OUT)/steps as a DAG run would leave them.
demo-data: install
	$(AIRFLOW_ENV) $(PY) -m operators.pipeline.dataplane

# The Airflow UI on http://localhost:$(AIRFLOW_PORT) (scheduler, dag-processor, API server,
# triggerer; LocalExecutor on SQLite). The DAG starts paused: trigger it from the form.
airflow: install
	@mkdir -p $(OUT)/airflow
	@echo "Airflow UI: http://localhost:$(AIRFLOW_PORT)  user: admin"
	@echo "password: in $(abspath $(OUT))/airflow/simple_auth_manager_passwords.json.generated"
	@echo "  (written on first start; also printed by 'airflow standalone' below)"
	@# standalone starts its scheduler, API server, ... as `airflow` from PATH: the venv's.
	$(AIRFLOW_ENV) AIRFLOW__API__HOST=127.0.0.1 AIRFLOW__API__PORT=$(AIRFLOW_PORT) \
		AIRFLOW__API__BASE_URL=http://localhost:$(AIRFLOW_PORT) \
		AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=$(AIRFLOW_LOG_PORT) \
		AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT=$(AIRFLOW_TRIGGER_LOG_PORT) \
		PATH="$(abspath $(VENV))/bin:$$PATH" AIRFLOW__CORE__PARALLELISM=$${AIRFLOW__CORE__PARALLELISM:-4} \
		$(VENV)/bin/airflow standalone

# Debian's Chromium, for the UI tests (tests/e2e/test_airflow_ui.py drives it with Playwright;
# Playwright's own browser download cannot work offline). From apt, as root or through sudo.
# CHROMIUM=/path (or $SLIPWAY_CHROMIUM, which the tests read) points the tests at another one.
CHROMIUM ?= $(or $(SLIPWAY_CHROMIUM),/usr/bin/chromium)
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@test -x $(CHROMIUM) || { echo "installing Debian's chromium (apt-get)"; \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null; }
	@test -x $(CHROMIUM) || { echo "no Chromium at $(CHROMIUM)"; exit 1; }

test: install install-parity browser
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	SLIPWAY_CHROMIUM="$(CHROMIUM)" $(VENV)/bin/pytest

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install datatrove-venv torch-venv
	@# As modules from the checkout's root: the benchmarks share tests/support with the tests.
	@# Every benchmark runs and prints its ratios; one that fails (or finds outputs that
	@# differ from its baseline's) fails `make bench` at the end, naming it.
	@failed=""; \
	for b in tests/bench/bench_*.py; do echo "== $$b"; \
		$(PY) -m tests.bench.$$(basename $$b .py) || failed="$$failed $$b"; done; \
	echo "== tests/bench/reference_pytorch.py"; \
	$(TORCH_VENV)/bin/python -m tests.bench.reference_pytorch || failed="$$failed reference_pytorch"; \
	if [ -n "$$failed" ]; then echo "failed:$$failed"; exit 1; fi

# The PyTorch reference the trainer's MFU target is set against (tests/bench/reference_pytorch.py).
# PyTorch is no dependency of Slipway: it goes into its own venv, which sees .venv's packages
# through a .pth file. On the dev VMs pip takes a local CPU build of torch; from PyPI on Linux
# x86_64 the default wheel is a multi-GB CUDA build, which also runs on the CPU.
TORCH_VENV := .venv-pytorch
TORCH_VERSION ?= 2.13.0
# rebuilt when .venv is (its stamp changes name) or the torch version changes
TORCH_STAMP := $(TORCH_VENV)/.installed-$(TORCH_VERSION)-$(notdir $(STAMP))
$(TORCH_STAMP): $(STAMP)
	@test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	@# addsitedir, not a bare path: .venv's own .pth files (the editable install) must run too
	@$(TORCH_VENV)/bin/python -c "import site, sys; open(site.getsitepackages()[0] + '/slipway-venv.pth', 'w').write('import site; site.addsitedir(%r)\\n' % sys.argv[1])" \
		"$$($(PY) -c 'import site; print(site.getsitepackages()[0])')"
	$(TORCH_VENV)/bin/python -m pip install --quiet torch==$(TORCH_VERSION)
	@rm -f $(TORCH_VENV)/.installed-* && touch $@

torch-venv: $(TORCH_STAMP)

bench-pytorch: install torch-venv
	$(TORCH_VENV)/bin/python -m tests.bench.reference_pytorch

# DataTrove, the data plane's baseline in tests/bench/bench_datatrove.py: no dependency of
# Slipway (never in requirements.lock), so it gets its own venv, pinned by
# tests/bench/datatrove-requirements.txt and rebuilt when that file changes.
DATATROVE_VENV := .venv-datatrove
DATATROVE_STAMP := $(DATATROVE_VENV)/.installed-$(shell cat tests/bench/datatrove-requirements.txt 2>/dev/null | sha1sum | cut -c1-12)
$(DATATROVE_STAMP):
	@test -x $(DATATROVE_VENV)/bin/python || $(PYTHON) -m venv $(DATATROVE_VENV)
	$(DATATROVE_VENV)/bin/python -m pip install --quiet -r tests/bench/datatrove-requirements.txt
	@rm -f $(DATATROVE_VENV)/.installed-* && touch $@

datatrove-venv: $(DATATROVE_STAMP)

clean:
	rm -rf $(OUT) .pytest_cache .ruff_cache $(TORCH_VENV) $(DATATROVE_VENV)
