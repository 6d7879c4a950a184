"""Token corpora on disk: `--dataset tokens:GLOB`, read by memory map, never held whole.

Three forms, told apart by what the glob matches:
- **Flat token files** (`*.bin`, the format nanoGPT's and llm.c's preparation scripts write): the
  tokens back to back as uint16 or uint32. The dtype is stated either by llm.c's header (256
  int32: magic 20240520, version 1 for uint16 or 2 for uint32, the token count; `write_tokens`
  writes it) or by a sidecar `FILE.json` (`{"dtype": "uint16", "vocab": 50257}`; nanoGPT's raw
  files get one). A file whose payload is not a whole number of tokens, or whose count differs
  from its header's, is refused in one line.
- **Parquet files** (`*.parquet`) or a **Hugging Face `datasets` folder** (`save_to_disk`'s:
  `state.json` and `*.arrow` files) with an `input_ids` column of token lists: the documents
  are joined into one stream through pyarrow (the `datasets` extra), once, into memory as
  uint32 (4 bytes a token: a 1B-token corpus wants 4 GB; convert it to a flat file for more).

The files, sorted by name, make one corpus; each file is cut into windows of `sequence + 1`
tokens that overlap by one (a window's inputs are its first `sequence` tokens, its labels the
last `sequence`), so the windows tile every file's tokens and every token is an input once per
epoch (a file's last `len % sequence` tokens are not); no window crosses a file's end. The last
windows (0.1 %, at least 1 and at most 256) are the test split; the rest train, drawn in the
sharder's seeded order (`gradmesh.data.sharding`): each data-parallel rank reads only its own
windows, and a resumed job, skipping the steps its checkpoint holds, reads the exact next ones.

The vocabulary is the sidecar's `vocab`, or the largest token + 1 (one pass over the memory map
at start: 7 ms for 50M uint16 tokens in the page cache); a token past a stated vocabulary is one
line.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradmesh.data.registry import DATASETS, DataOptions, DataSpec, Split
from gradmesh.errors import GradmeshError

MAGIC, HEADER_INTS = 20240520, 256
VERSIONS = {1: np.uint16, 2: np.uint32}
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
TEST_SHARE, TEST_MOST = 0.001, 256


def write_tokens(path: str | Path, tokens: Any) -> Path:
    """Write `tokens` (ints) as a flat token file with llm.c's header: uint16 when every token
    fits, else uint32."""
    array = np.asarray(tokens)
    big = array.size and int(array.max()) > np.iinfo(np.uint16).max
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (MAGIC, 2 if big else 1, array.size)
    target = Path(path)
    with target.open("wb") as f:
        f.write(header.tobytes())
        f.write(array.astype(np.uint32 if big else np.uint16).tobytes())
    return target


def token_file(path: Path) -> tuple[np.ndarray, int]:
    """A flat token file's tokens as a read-only memory map, and its sidecar's vocabulary (0
    where none is stated); one line when its dtype or its size is wrong."""
    size = path.stat().st_size
    first = np.fromfile(path, dtype=np.int32, count=min(HEADER_INTS, size // 4))
    sidecar = path.with_name(path.name + ".json")
    vocab = 0
    if len(first) == HEADER_INTS and first[0] == MAGIC:
        dtype, offset = VERSIONS.get(int(first[1])), HEADER_INTS * 4
        if dtype is None:
            raise GradmeshError(f"token file {path}: header version {first[1]} is not 1 or 2")
        count = int(first[2])
    elif sidecar.is_file():
        stated = _sidecar(sidecar)
        dtype, offset, count = DTYPES[stated["dtype"]], 0, -1
        vocab = int(stated.get("vocab", 0))
    else:
        raise GradmeshError(
            f"token file {path}: no llm.c header and no sidecar {sidecar.name} stating its dtype "
            '(write {"dtype": "uint16"} or "uint32" there)'
        )
    width = np.dtype(dtype).itemsize
    payload = size - offset
    if payload % width or (count >= 0 and payload // width != count):
        raise GradmeshError(
            f"token file {path}: {payload} bytes of tokens is not "
            + (
                f"{count} {np.dtype(dtype).name} tokens as its header says"
                if count >= 0
                else f"a whole number of {np.dtype(dtype).name} tokens"
            )
        )
    if payload == 0:
        return np.zeros(0, dtype=dtype), vocab
    return np.memmap(path, dtype=dtype, mode="r", offset=offset), vocab


def _sidecar(path: Path) -> dict[str, Any]:
    try:
        stated = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GradmeshError(f"token sidecar {path}: {exc}") from None
    if not isinstance(stated, dict) or stated.get("dtype") not in DTYPES:
        raise GradmeshError(f"token sidecar {path}: 'dtype' must be uint16 or uint32")
    if not isinstance(stated.get("vocab", 0), int) or stated.get("vocab", 0) < 0:
        raise GradmeshError(f"token sidecar {path}: 'vocab' must be a whole number")
    return stated


def arrow_tokens(paths: list[Path]) -> np.ndarray:
    """The `input_ids` of parquet files or a `datasets` folder's arrow files, joined into one
    uint32 stream (the module docstring)."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise GradmeshError(
            "parquet and datasets folders need the datasets extra: pip install 'gradmesh[datasets]'"
        ) from None
    parts = []
    for path in paths:
        try:
            if path.suffix == ".parquet":
                table = pq.read_table(path, columns=["input_ids"])
            else:
                with pa.memory_map(str(path)) as source:
                    table = pa.ipc.open_stream(source).read_all().select(["input_ids"])
            column = table.column("input_ids")
            flat = [pc.list_flatten(chunk) for chunk in column.chunks]
            parts += [values.to_numpy(zero_copy_only=False) for values in flat]
        except (KeyError, pa.ArrowException, OSError) as exc:
            raise GradmeshError(
                f"token data {path}: no input_ids column of token lists ({exc})"
            ) from None
    joined = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
    if joined.size and (joined.min() < 0 or joined.max() > np.iinfo(np.uint32).max):
        raise GradmeshError(f"token data {paths[0].parent}: input_ids outside 0..2^32-1")
    return joined.astype(np.uint32)


def corpus_files(pattern: str) -> list[tuple[np.ndarray, int, str]]:
    """(tokens, stated vocabulary, name) of each file the glob matches, sorted by name."""
    if not pattern.strip():  # Path("") is the working directory: every file in it
        raise GradmeshError(
            "dataset tokens: names no files: give a file, a glob or a folder after the colon, "
            "like tokens:/data/train-*.bin"
        )
    root = Path(pattern)
    if root.is_dir():  # a datasets folder (save_to_disk) or a folder of token files
        arrows = sorted(root.glob("*.arrow"))
        if arrows:
            return [(arrow_tokens(arrows), 0, str(root))]
        pattern = str(root / "*")
    found = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_file())
    found = [p for p in found if p.suffix != ".json"]
    if not found:
        raise GradmeshError(f"dataset tokens:{pattern}: no file matches")
    parquet = [p for p in found if p.suffix == ".parquet"]
    if parquet:
        return [(arrow_tokens(parquet), 0, pattern)]
    return [(*token_file(p), str(p)) for p in found]


@dataclass(frozen=True)
class Corpus:
    """Windows of `sequence + 1` tokens over the files: window w is file f's w - starts[f]."""

    files: list[np.ndarray]
    names: list[str]
    sequence: int
    starts: np.ndarray
    """The first window of each file, and the total count last."""
    vocab: int

    def read(self, ids: np.ndarray) -> torch.Tensor:
        """Windows `ids` as an int64 (len(ids), sequence + 1) tensor."""
        out = np.empty((len(ids), self.sequence + 1), dtype=np.int64)
        where = np.searchsorted(self.starts, ids, side="right") - 1
        span = np.arange(self.sequence + 1)
        for f in np.unique(where):
            rows = where == f
            first = (ids[rows] - self.starts[f]) * self.sequence
            out[rows] = self.files[f][first[:, None] + span]
        return torch.from_numpy(out)


class Windows:
    """The inputs (`shift` 0) or labels (1) of a run of windows, read on indexing: what a
    `TokenSplit`'s `x` and `y` are, for callers that take a split's first samples."""

    def __init__(self, corpus: Corpus, first: int, count: int, shift: int) -> None:
        self.corpus, self.first, self.count, self.shift = corpus, first, count, shift

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: Any) -> torch.Tensor:
        window = self.corpus.read(self.first + _positions(index, self.count))
        return window[:, self.shift : self.shift + self.corpus.sequence]


def _positions(index: Any, count: int) -> np.ndarray:
    if isinstance(index, slice):
        return np.arange(count)[index]
    positions = np.asarray(index.cpu() if torch.is_tensor(index) else index, dtype=np.int64)
    return positions.reshape(-1)


class TokenSplit(Split):
    """A split whose samples are windows of a corpus on disk, read when `rows` asks for them
    (each window once: inputs and labels from the same read)."""

    lazy = True
    """Worth fetching in the background (`gradmesh.data.prefetch`)."""

    def __init__(self, corpus: Corpus, first: int, count: int) -> None:
        super().__init__(Windows(corpus, first, count, 0), Windows(corpus, first, count, 1))
        object.__setattr__(self, "corpus", corpus)

    def __len__(self) -> int:
        return len(self.x)

    def rows(self, index: Any) -> Split:
        first, count = self.x.first, self.x.count
        window = self.corpus.read(first + _positions(index, count))  # type: ignore[attr-defined]
        return Split(window[:, :-1], window[:, 1:])

    def to(self, device: Any) -> Split:
        return self.rows(slice(None)).to(device)


def corpus(pattern: str, sequence: int) -> Corpus:
    files = corpus_files(pattern)
    if sequence < 1:
        raise GradmeshError(f"dataset tokens:{pattern}: --sequence-length must be at least 1")
    counts = [max(0, (len(t) - 1) // sequence) for t, _, _ in files]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    stated = max(v for _, v, _ in files)
    largest = max((int(t.max()) for t, _, _ in files if len(t)), default=-1)
    if stated and largest >= stated:
        at = next(name for t, _, name in files if len(t) and int(t.max()) == largest)
        raise GradmeshError(
            f"token file {at}: token {largest} is past the stated vocabulary of {stated}"
        )
    return Corpus(
        [t for t, _, _ in files], [n for _, _, n in files], sequence, starts,
        stated or largest + 1,
    )  # fmt: skip


def load_tokens(pattern: str, options: DataOptions) -> DataSpec:
    """The corpus the glob names, split into train and test windows (the module docstring)."""
    found = corpus(pattern, options.sequence)
    total = int(found.starts[-1])
    test = min(TEST_MOST, max(1, int(total * TEST_SHARE)))
    if total < test + 1:
        raise GradmeshError(
            f"dataset tokens:{pattern}: {total} windows of --sequence-length {options.sequence} "
            "tokens; it needs at least 2"
        )
    return DataSpec(
        TokenSplit(found, 0, total - test),
        TokenSplit(found, total - test, test),
        (options.sequence,),
        found.vocab,
    )


DATASETS.schemes["tokens"] = lambda pattern: lambda options: load_tokens(pattern, options)
