# Two commands on a fresh machine: `make demo` and `make test`. Each sets up .venv first.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.meshforge-installed
# CHAOS_SCALE multiplies the order checker's workload time and sets the crash suite's kills
# (4 per point at 1, 12 x CHAOS_SCALE above: `make chaos` runs 240 and ~8 minutes of checker
# per store).
CHAOS_SCALE ?= 1
# `make test` runs the tests in this many processes (each session has its own nats-server
# and PostgreSQL database). Four keep 2 cores busy while tests wait (812 s of CPU in 705 s
# of pytest); six saved another 80 s but starved timing-sensitive tests into failures.
# tests/conftest.py says which tests go together.
TEST_JOBS ?= 4

.PHONY: setup browser demo test test-stalled lint unit integration chaos bench clean

setup: $(STAMP) browser

# The console's browser tests drive Debian's chromium (Playwright downloads no browser).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  SUDO=; [ "$$(id -u)" -eq 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "MeshForge needs Python 3.11+, found " + sys.version.split()[0]'
	@command -v java >/dev/null || echo "warning: java not found; the Spark pipeline needs Java 17+"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[all,dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/meshforge demo

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/lint-imports

PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 -n $(TEST_JOBS) --dist loadgroup

test: $(STAMP) browser lint
	$(PYTEST)

# The same suite with every test worker stopped 0.15 s every 2 s, as a loaded CI machine
# stalls a process: a test with a margin smaller than that fails here first.
test-stalled: $(STAMP) browser
	$(BIN)/python tests/stalled.py --stall 0.15 --every 2 -- $(wordlist 4,100,$(PYTEST))

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration

chaos: $(STAMP)
	CHAOS_SCALE=20 MESHFORGE_FUZZ_EXAMPLES=200 $(BIN)/python -m pytest -q tests/chaos tests/integration/test_fuzz_hostile.py --timeout 3600

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) .meshforge .pytest_cache .mypy_cache .ruff_cache build dist
