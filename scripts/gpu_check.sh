#!/usr/bin/env bash
# gradmesh's GPU check (docs/gpu.md): every GPU path once, one table; over 12 minutes on an H200
# (GPU_CHECK_BUDGET_S and GPU_CHECK_FROM split it over calls).
# Run from anywhere; uses this checkout's package and the python on the PATH (torch, numpy,
# pytest already there; nothing is downloaded). A torchao wheel in .whl/ is used for fp8 when
# torchao is not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torchao.float8" 2>/dev/null && compgen -G ".whl/torchao-*.whl" >/dev/null; then
    site=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/torchao-*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" scripts/gpu_check.py "$@"
