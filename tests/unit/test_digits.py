"""The digits dataset is scikit-learn's, read from the file it ships without importing it."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from sklearn.datasets import load_digits as sklearn_digits

from gradmesh.data.digits import digits_arrays, load_digits
from gradmesh.data.registry import DataOptions


def test_the_arrays_are_sklearns_and_the_split_is_fixed() -> None:
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
