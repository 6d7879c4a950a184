"""The digits dataset is scikit-learn's, read from the file it ships without importing it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gradmesh.data.digits import digits_arrays, load_digits
from gradmesh.data.registry import DataOptions
from tests.harness import kept_environment


def test_the_arrays_are_sklearns_and_the_split_is_fixed() -> None:
    # imported here: scikit-learn's datasets take about a second, in each worker that collects;
    # scikit-learn sets KMP_* variables on import, which the leak check would count
    with kept_environment():
        from sklearn.datasets import load_digits as sklearn_digits

    images, labels = digits_arrays()
    bunch = sklearn_digits()
    assert np.array_equal(images, bunch.data) and np.array_equal(labels, bunch.target)
    spec = load_digits(DataOptions())
    assert (len(spec.train.y), len(spec.test.y)) == (1438, 359)
    assert float(spec.train.x.max()) == 1.0 and spec.train.x.shape[1:] == (1, 8, 8)


def test_loading_does_not_import_sklearn() -> None:
    code = (
        "import sys; from gradmesh.data.digits import load_digits;"
        "from gradmesh.data.registry import DataOptions; load_digits(DataOptions());"
        "print('sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_docstrings_are_parsed_once_and_read_back_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The text and docstrings datasets' documents are kept on disk after the first parse
    (every rank of every job paid about 1 s for it); an edited source, or a cache that is
    damaged or cannot be written, is parsed again."""
    from gradmesh.data import docstrings

    package = tmp_path / "pkg"
    (package / "test").mkdir(parents=True)
    (package / "a.py").write_text('"""One module docstring here."""\n')
    (package / "test" / "b.py").write_text('"""A test file, left out."""\n')
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = docstrings._documents(package)
    assert first == ["One module docstring here."]
    (kept,) = (tmp_path / "cache" / "gradmesh").iterdir()
    kept.write_text('["read from the cache"]')
    assert docstrings._documents(package) == ["read from the cache"]
    kept.write_text("{broken")
    assert docstrings._documents(package) == first
    (package / "a.py").write_text('"""Another, longer module docstring."""\n')  # a new key
    assert docstrings._documents(package) == ["Another, longer module docstring."]
    monkeypatch.setenv("XDG_CACHE_HOME", str(package / "a.py"))  # a file: nothing is written
    assert docstrings._documents(package) == ["Another, longer module docstring."]
