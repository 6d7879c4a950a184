# Two entry points a fresh machine needs: `make run` (the main job) and `make test` (the suite).
# `make run` installs only what the main job needs; `make test` adds the test tools and every
# optional extra (plots, TensorBoard, Ray, Spark, transformers, torchao, datasets), so CI exercises
# them all.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
PIP := $(BIN)/pip install --quiet -c constraints.txt
EXTRAS := test,plot,tensorboard,ray,spark,hf,fp8,datasets

.PHONY: install run test lint clean

$(RUN_STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(PIP) -e .
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP)
	@# the emulated cluster needs iproute2 (ip, tc) and ethtool; install them where we can (root)
	@if [ "$$(id -u)" = 0 ] && ! (command -v ip && command -v tc && command -v ethtool) >/dev/null; then \
		(apt-get install -y -qq iproute2 ethtool >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq iproute2 ethtool >/dev/null 2>&1)) || \
		echo "could not install iproute2/ethtool: emulated-cluster tests will be skipped"; fi
	$(PIP) -e '.[$(EXTRAS)]'
	touch $(TEST_STAMP)

install: $(TEST_STAMP)

run: $(RUN_STAMP)
	$(BIN)/gradmesh train

test: $(TEST_STAMP)
	$(BIN)/ruff check gradmesh tests examples scripts
	$(BIN)/mypy
	@# the suite starts ~1,000 Python processes: compiled once here, not in each of them
	@# (with PYTHONDONTWRITEBYTECODE set, imports never write their .pyc)
	$(BIN)/python -m compileall -q gradmesh tests examples > /dev/null
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=25

lint: $(TEST_STAMP)
	$(BIN)/ruff check gradmesh tests examples scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info
