# Two entry points a fresh machine needs: `make run` (the main job) and `make test` (the suite).
# `make run` installs only what the main job needs; `make test` adds the test tools and every
# optional extra (plots, TensorBoard, Ray, Spark, transformers, torchao, datasets), so CI exercises
# them all.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
# pip byte-compiles what it installs on one core (half of `make install`'s time); compileall does
# it on every core. Its errors are files for other Pythons (torch's py312 examples), which pip
# skips too.
PIP := $(BIN)/pip install --quiet --no-compile -c constraints.txt
COMPILE := $(BIN)/python -m compileall -qq -j 0 $(VENV)/lib > /dev/null || true
EXTRAS := test,plot,tensorboard,ray,spark,hf,fp8,datasets

.PHONY: install run test lint clean

$(RUN_STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(PIP) -e .
	$(COMPILE)
	touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP)
	@# the emulated cluster needs iproute2 (ip, tc) and ethtool; install them where we can (root)
	@if [ "$$(id -u)" = 0 ] && ! (command -v ip && command -v tc && command -v ethtool) >/dev/null; then \
		(apt-get install -y -qq iproute2 ethtool >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq iproute2 ethtool >/dev/null 2>&1)) || \
		echo "could not install iproute2/ethtool: emulated-cluster tests will be skipped"; fi
	$(PIP) -e '.[$(EXTRAS)]'
	$(COMPILE)
	touch $(TEST_STAMP)

install: $(TEST_STAMP)

run: $(RUN_STAMP)
	$(BIN)/gradmesh train

test: $(TEST_STAMP)
	$(BIN)/ruff check gradmesh tests examples scripts
	@# the suite starts ~1,000 Python processes: compiled once here, not in each of them
	@# (with PYTHONDONTWRITEBYTECODE set, imports never write their .pyc)
	$(BIN)/python -m compileall -q gradmesh tests examples > /dev/null
	@# mypy (40 s of one core) runs beside the suite, whose two workers leave the cores idle
	@# about a quarter of the time (processes starting, waits); its output follows the suite's
	@$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & types=$$!; \
	$(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=25; suite=$$?; \
	wait $$types; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	exit $$(( suite ? suite : typed ))

lint: $(TEST_STAMP)
	$(BIN)/ruff check gradmesh tests examples scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info
