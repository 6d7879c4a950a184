"""A language-modelling task that ships on every machine: the bytes of the Python standard
library's own docstrings (the ten packages of `gradmesh.data.docstrings`), cut into sequences.

Byte-level (vocabulary 256, no tokenizer to download or train): each sample is `sequence`
consecutive bytes, its labels the same bytes shifted by one (the next byte at each position).
Documents are joined with a blank line, in the order the packages and their files sort, and cut
into non-overlapping windows; one window in ten (chosen by a fixed seed) is held out for test.
The corpus is the running interpreter's: the same on every machine with the same Python
version (about 0.5 MB of text on CPython 3.11).
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch

from gradmesh.data.digits import split_indices
from gradmesh.data.docstrings import PACKAGES, _documents
from gradmesh.data.registry import DATASETS, DataOptions, DataSpec, Split
from gradmesh.errors import GradmeshError

SPLIT_SEED = 12
VOCAB = 256


@functools.cache
def corpus() -> bytes:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = [doc for name in PACKAGES if (root / name).is_dir() for doc in _documents(root / name)]
    return "\n\n".join(docs).encode("utf-8")


@DATASETS.register("text")
def make_text(options: DataOptions) -> DataSpec:
    seq = options.sequence
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()
    windows = (len(data) - 1) // seq
    if seq < 2 or windows < 20:
        raise GradmeshError(f"dataset text: --sequence-length {seq} leaves {windows} samples")
    x = data[: windows * seq].view(windows, seq)
    y = data[1 : windows * seq + 1].view(windows, seq)
    train, test = split_indices(windows, 0.1, SPLIT_SEED)
    return DataSpec(Split(x[train], y[train]), Split(x[test], y[test]), (seq,), VOCAB)
