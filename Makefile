# Two entry points a fresh machine needs: `make run` (the main job) and `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test lint clean

$(STAMP): pyproject.toml constraints.txt
	@# the emulated cluster needs iproute2 (ip, tc) and ethtool; install them where we can (root)
	@if [ "$$(id -u)" = 0 ] && ! (command -v ip && command -v tc && command -v ethtool) >/dev/null; then \
		(apt-get install -y -qq iproute2 ethtool >/dev/null 2>&1 || \
		 (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq iproute2 ethtool >/dev/null 2>&1)) || \
		echo "could not install iproute2/ethtool: emulated-cluster tests will be skipped"; fi
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,plot,tensorboard,ray,spark]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/gradmesh train

test: $(STAMP)
	$(BIN)/ruff check gradmesh tests examples
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check gradmesh tests examples
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info
