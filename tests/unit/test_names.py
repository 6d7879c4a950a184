"""The built-in names the launcher checks without torch (`gradmesh.names`) are the registries'."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gradmesh.errors import GradmeshError
from gradmesh.names import WHERE, check, registry


@pytest.mark.parametrize("kind", sorted(WHERE))
def test_each_tuple_is_its_registry_s_names(kind: str) -> None:
    assert sorted(WHERE[kind][0]) == registry(kind).names()


def test_unknown_names_get_the_registry_s_one_line_error() -> None:
    with pytest.raises(GradmeshError, match=r"unknown strategy 'dilocco' \(valid: allreduce, "):
        check("strategy", "dilocco")
    check("model", "GPT")  # case, as the registries match it
    with pytest.raises(GradmeshError, match="cannot import nowhere_at_all"):
        check("model", "nowhere_at_all:factory")


def test_checking_a_run_s_flags_imports_no_torch() -> None:
    """The launcher's parent checks every name before starting its workers, without torch."""
    code = (
        "import sys; from gradmesh.train.config import TrainConfig; "
        "from gradmesh.train.checks import check_train; "
        "check_train(TrainConfig.of(strategy='diloco', model='gpt', dataset='text', "
        "compression='int8', averaging_algorithm='ring')); "
        "check_train(TrainConfig.of(model='bag', dataset='docstrings')); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
