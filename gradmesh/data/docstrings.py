"""A sparse text task that ships on every machine: the Python standard library's own docstrings,
labelled by the package they come from.

Every function, class and module docstring (three words or more) of ten packages that every
CPython install carries is one document; its label is the package. Documents become hashed
bag-of-n-gram features: lower-cased words and word pairs, hashed with CRC-32 into `BUCKETS`
buckets (0 is padding), the first `FEATURES` of each document kept in order. Inputs are therefore
int64 feature ids of shape (FEATURES,), and a linear model over them touches about a hundred rows of
its weight per sample: the regime Hogwild! is meant for.

Written here rather than with scikit-learn's HashingVectorizer because the model needs a fixed
number of ordered feature ids per document (EmbeddingBag input), not a CSR matrix, and the hash
must be the same in every process (Python's own `hash` of strings is salted per process).
The corpus is the running interpreter's: the same on every machine with the same Python version
(2134 documents on CPython 3.11).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import re
import sysconfig
import zlib
from pathlib import Path

import torch

from gradmesh.data.digits import split_indices
from gradmesh.data.registry import DATASETS, DataOptions, DataSpec, Split
from gradmesh.errors import GradmeshError

PACKAGES = (
    "asyncio",
    "concurrent",
    "email",
    "http",
    "importlib",
    "logging",
    "multiprocessing",
    "unittest",
    "urllib",
    "xml",
)
BUCKETS = 1 << 18
_CACHE_VERSION = 1  # of the docstring lists kept on disk (`_documents`)
FEATURES = 128
MIN_WORDS = 3
SPLIT_SEED = 11
_WORD = re.compile(r"[a-z_][a-z0-9_]+")


def _sources(package: Path) -> list[Path]:
    return [
        path
        for path in sorted(package.rglob("*.py"))
        if "test" not in path.relative_to(package).parts[:-1] and not path.name.startswith("test_")
    ]


def _documents(package: Path) -> list[str]:
    """The package's docstrings of `MIN_WORDS` words or more, read once per machine: parsing
    the files costs about 1 s, paid by every rank of every job, so the list is kept under
    `~/.cache/gradmesh` (`XDG_CACHE_HOME`), keyed by the files' paths, sizes and times; a
    cache that cannot be read or written is skipped."""
    sources = _sources(package)
    key = hashlib.sha256(repr((_CACHE_VERSION, MIN_WORDS, str(package))).encode())
    for path in sources:
        stat = path.stat()
        key.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    cache = _cache_dir() / f"docstrings-{package.name}-{key.hexdigest()[:16]}.json"
    try:
        kept = json.loads(cache.read_text(encoding="utf-8"))
        if isinstance(kept, list) and all(isinstance(doc, str) for doc in kept):
            return kept
    except (OSError, ValueError):
        pass
    docs = _parse(sources)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        part = cache.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps(docs), encoding="utf-8")
        os.replace(part, cache)  # atomic: ranks writing at once each leave a whole file
    except OSError:
        pass
    return docs


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gradmesh"


def _parse(sources: list[Path]) -> list[str]:
    docs = []
    for path in sources:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc.split()) >= MIN_WORDS:
                    docs.append(doc)
    return docs


def features(text: str) -> list[int]:
    """The hashed word and word-pair ids of `text` (1 .. BUCKETS - 1), first FEATURES kept."""
    words = _WORD.findall(text.lower())
    grams = words + [f"{a} {b}" for a, b in zip(words, words[1:], strict=False)]
    return [zlib.crc32(g.encode()) % (BUCKETS - 1) + 1 for g in grams[:FEATURES]]


@functools.cache
def _corpus() -> tuple[torch.Tensor, torch.Tensor]:
    root = Path(sysconfig.get_paths()["stdlib"])
    rows: list[list[int]] = []
    labels: list[int] = []
    for label, name in enumerate(PACKAGES):
        if not (root / name).is_dir():
            raise GradmeshError(f"dataset docstrings: the standard library has no package {name}")
        for doc in _documents(root / name):
            rows.append(features(doc))
            labels.append(label)
    x = torch.zeros((len(rows), FEATURES), dtype=torch.int64, device="cpu")
    for i, ids in enumerate(rows):
        x[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64, device="cpu")
    return x, torch.tensor(labels, dtype=torch.int64, device="cpu")


@DATASETS.register("docstrings")
def make_docstrings(_options: DataOptions) -> DataSpec:
    x, y = _corpus()
    train, test = split_indices(len(y), 0.2, SPLIT_SEED)
    return DataSpec(
        Split(x[train], y[train]),
        Split(x[test], y[test]),
        (FEATURES,),
        len(PACKAGES),
        vocab=BUCKETS,
    )
