#!/usr/bin/env bash
# Run Horovod's own PyTorch tests (test/parallel/test_torch.py of a Horovod source tree you
# have) through gradmesh's drop-in, on NP CPU ranks:
#   bash scripts/horovod_suite.sh /path/to/horovod 2 [pytest args...]
# A shim package named `horovod` (horovod.torch = gradmesh.horovod) and the three helpers the
# test imports from Horovod's test/utils/common.py are written to a temporary folder; the test
# file itself is read from the given tree, never copied into this repository. Each rank writes
# its pytest report to $OUT_DIR/rank-R.txt (default: the temporary folder, printed at the end).
# HOROVOD_RANK and HOROVOD_SIZE are set as `horovodrun --gloo` sets them (gradmesh runs on
# Gloo), which Horovod's tests read to tell a Gloo job from an MPI one.
set -euo pipefail
src=${1:?usage: horovod_suite.sh HOROVOD_SOURCE_TREE NP [pytest args]}
np=${2:?usage: horovod_suite.sh HOROVOD_SOURCE_TREE NP [pytest args]}
shift 2
test_file="$src/test/parallel/test_torch.py"
[ -f "$test_file" ] || { echo "horovod_suite: no $test_file (give a Horovod source tree)" >&2; exit 2; }
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$here/.venv/bin/python}
work=$(mktemp -d /tmp/gradmesh-horovod-suite-XXXXXX)
out=${OUT_DIR:-$work}
mkdir -p "$work/shim/horovod/torch" "$work/test/parallel" "$work/test/utils" "$out"
cp "$test_file" "$work/test/parallel/test_torch.py"
cat > "$work/shim/horovod/__init__.py" <<'PY'
PY
cat > "$work/shim/horovod/torch/__init__.py" <<'PY'
"""horovod.torch as gradmesh's drop-in (for running Horovod's own tests)."""
from gradmesh.horovod import *  # noqa: F403
from gradmesh.horovod import __all__ as _names
import gradmesh.horovod as _gm
for _name in dir(_gm):
    if not _name.startswith("__"):
        globals()[_name] = getattr(_gm, _name)
PY
cat > "$work/test/utils/common.py" <<'PY'
"""The helpers test_torch.py imports from Horovod's test/utils/common.py, written for gradmesh."""
import contextlib, os, tempfile

def mpi_env_rank_and_size():
    """(rank, size) from the launcher's environment; (0, 1) outside a job."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))

def skip_or_fail_gpu_test(test, message):
    if int(os.environ.get("HOROVOD_TEST_GPU", 0)):
        test.fail(message)
    test.skipTest(message)

@contextlib.contextmanager
def temppath():
    with tempfile.TemporaryDirectory() as folder:
        yield os.path.join(folder, "temp_test_file")
PY
if [ "${WITHOUT_MUON:-0}" = 1 ]; then
  # test_broadcast_state, test_broadcast_state_options and test_force_allreduce build every
  # torch.optim.Optimizer subclass with 1-D parameters; torch.optim.Muon (torch 2.9 on, newer
  # than Horovod's tests) refuses them, whatever runs the collectives. This hides Muon from that
  # list only, to show those tests pass otherwise.
  cat > "$work/test/parallel/conftest.py" <<'PY'
import torch
_real = type.__subclasses__
torch.optim.Optimizer.__subclasses__ = classmethod(
    lambda cls: [c for c in _real(cls) if c.__name__ != "Muon"])
PY
fi
cd "$work/test/parallel"
export PYTHONPATH="$work/shim:$here${PYTHONPATH:+:$PYTHONPATH}"
status=0
gradmesh=$(dirname "$python")/gradmesh
# each rank's own report: bash expands RANK, which the launcher sets per worker
timeout "${SUITE_TIMEOUT_S:-3600}" "$gradmesh" run -np "$np" -- bash -c \
  "HOROVOD_RANK=\$RANK HOROVOD_SIZE=\$WORLD_SIZE HOROVOD_LOCAL_RANK=\$LOCAL_RANK \
   HOROVOD_LOCAL_SIZE=\$LOCAL_WORLD_SIZE exec \"$python\" -m pytest -p no:cacheprovider -rs -v test_torch.py $* > \"$out/rank-\$RANK.txt\" 2>&1" \
  > "$out/run.log" 2>&1 || status=$?
for f in "$out"/rank-*.txt; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$f" | tail -n 20; done
tail -n 5 "$out/run.log"
echo "horovod_suite: np=$np exit=$status log=$out/run.log"
exit $status
