"""Token corpora on disk (`--dataset tokens:GLOB`, `gradmesh.data.tokens`): the formats, the
windows that tile them, an epoch over data-parallel ranks reading every token once, and the
one-line refusals of bad files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gradmesh.data import DATASETS, GlobalBatchSharder
from gradmesh.data.registry import DataOptions
from gradmesh.data.tokens import write_tokens
from gradmesh.errors import GradmeshError

SEQ = 16


def load(pattern: str | Path, sequence: int = SEQ):  # type: ignore[no-untyped-def]
    return DATASETS.get(f"tokens:{pattern}")(DataOptions(sequence=sequence))


def test_windows_are_the_file_s_tokens_inputs_and_next_tokens(tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, 70_000, size=10_001)  # past uint16: uint32
    spec = load(write_tokens(tmp_path / "a.bin", tokens))
    assert spec.num_classes == tokens.max() + 1 and spec.input_shape == (SEQ,)
    assert len(spec.train) + len(spec.test) == 10_000 // SEQ
    part = spec.train.rows(torch.tensor([3, 0]))
    assert part.x[0].tolist() == tokens[3 * SEQ : 4 * SEQ].tolist()
    assert part.y[1].tolist() == tokens[1 : SEQ + 1].tolist()
    first = len(spec.train)  # the test windows are the last ones
    assert (
        spec.test.rows(slice(0, 1)).x[0].tolist()
        == tokens[first * SEQ : (first + 1) * SEQ].tolist()
    )


def test_a_nanogpt_file_with_a_sidecar_and_several_files_make_one_corpus(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    parts = [rng.integers(0, 50_000, size=n).astype(np.uint16) for n in (1_601, 3_201)]
    for i, part in enumerate(parts):
        part.tofile(tmp_path / f"train-{i}.bin")  # nanoGPT's prepare.py: raw uint16
        (tmp_path / f"train-{i}.bin.json").write_text(
            json.dumps({"dtype": "uint16", "vocab": 50257})
        )
    spec = load(tmp_path / "train-*.bin")
    assert spec.num_classes == 50257
    windows = spec.train.rows(torch.arange(len(spec.train)))
    assert len(spec.train) + len(spec.test) == 100 + 200  # no window crosses a file's end
    assert windows.x[100].tolist() == parts[1][:SEQ].tolist()


def test_an_epoch_over_four_ranks_reads_every_token_of_a_50m_file_once(tmp_path: Path) -> None:
    """Issue 61: 50M tokens, written here; the four ranks' windows of one epoch, put together,
    are every window once, and the windows' inputs tile the file (all but its last partial
    window's tokens)."""
    n, seq, batch = 50_000_000, 1024, 64
    tokens = np.arange(n, dtype=np.uint32) % 65_521  # recognisable: token i is i mod a prime
    spec = load(write_tokens(tmp_path / "big.bin", tokens), seq)
    seen = np.zeros(len(spec.train), dtype=np.int64)
    for rank in range(4):
        sharder = GlobalBatchSharder(len(spec.train), batch, rank, 4, seed=3)
        for indices, _ in sharder.batches(0):
            seen[indices.numpy()] += 1
    assert (seen == 1).all()
    some = torch.tensor([0, 7, len(spec.train) - 1])
    read = spec.train.rows(some).x.numpy()
    starts = some.numpy()[:, None] * seq + np.arange(seq)
    assert (read == starts % 65_521).all()


def test_parquet_and_a_datasets_folder_with_input_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("datasets", reason="the datasets extra is missing")
    import datasets
    import tqdm

    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)  # no monitor thread left behind
    datasets.disable_progress_bars()
    docs = [[1, 2, 3, 4, 5] * 7, [9, 8, 7] * 11, list(range(40))]
    table = datasets.Dataset.from_dict({"input_ids": docs, "text": ["a", "b", "c"]})
    table.to_parquet(str(tmp_path / "part-0.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    stream = [t for doc in docs for t in doc]
    for pattern in (tmp_path / "*.parquet", tmp_path / "saved"):
        spec = load(pattern, 8)
        got = spec.train.rows(torch.arange(len(spec.train))).x.reshape(-1).tolist()
        assert got == stream[: len(got)] and len(got) >= 8 * 10


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: p.write_bytes(b"\x01\x00" * 50 + b"\x07"), "no llm.c header and no sidecar"),
        (lambda p: (p.write_bytes(b"\x01\x00" * 50 + b"\x07"),
                    p.with_name(p.name + ".json").write_text('{"dtype": "uint16"}')),
         "101 bytes of tokens is not a whole number of uint16 tokens"),
        (lambda p: (write_tokens(p, np.arange(100)), p.write_bytes(p.read_bytes()[:-2])),
         "198 bytes of tokens is not 100 uint16 tokens as its header says"),
        (lambda p: (np.arange(300, dtype=np.uint16).tofile(p),
                    p.with_name(p.name + ".json").write_text('{"dtype": "uint16", "vocab": 256}')),
         "token 299 is past the stated vocabulary of 256"),
        (lambda p: None, "no file matches"),
    ],
    ids=["no-dtype", "size-not-a-multiple", "header-count", "past-vocabulary", "missing"],
)  # fmt: skip
def test_bad_token_files_are_one_line(tmp_path: Path, write, message: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "t.bin"
    write(path)
    with pytest.raises(GradmeshError) as caught:
        load(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_tokens_past_a_pretrained_model_s_vocabulary_are_one_line(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the hf extra is missing")
    from gradmesh.models.registry import MODELS

    transformers.utils.logging.disable_progress_bar()
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "m")
    with pytest.raises(
        GradmeshError, match=r"tokens past the vocabulary .*ids up to 99, and it has 64"
    ):
        MODELS.get(f"hf:{tmp_path / 'm'}")((SEQ,), 100)
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(GradmeshError, match="no model.safetensors or model.safetensors.index.json"):
        MODELS.get(f"hf:{tmp_path / 'm'}")((SEQ,), 10)


def test_the_loader_benchmark_reports_both_rates_and_their_ratio(tmp_path: Path) -> None:
    from gradmesh.bench.loader import Config, run

    out = tmp_path / "loader.json"
    config = Config(tokens=200_000, batches=20, steps=1, rounds=3, json=str(out))
    assert run(config) == 0
    got = json.loads(out.read_text())
    assert len(got["loader_rounds"]) == len(got["train_rounds"]) == 2  # the first warmed up
    assert got["ratio"] == pytest.approx(got["loader_tokens_per_s"] / got["train_tokens_per_s"])
    assert min(got["loader_rounds"] + got["train_rounds"]) > 0 and got["limit"] in (
        "cpu",
        "not cpu",
    )


def test_the_next_batch_is_read_on_a_thread_while_this_one_is_used() -> None:
    import threading

    from gradmesh.data.prefetch import prefetched

    started = {i: threading.Event() for i in range(4)}
    where = {}

    def fetch(i: int) -> int:
        where[i] = threading.current_thread().name
        started[i].set()
        return i * i

    parts = prefetched(range(4), fetch)
    got = []
    for i, value in parts:
        if i < 3:  # the next one is being read before this one is done with
            assert started[i + 1].wait(10), f"batch {i + 1} was not read ahead"
        got.append((i, value))
    assert got == [(i, i * i) for i in range(4)]
    assert all(name.startswith("gradmesh-prefetch") for name in where.values())
    early = prefetched(range(10), fetch)
    next(early)
    early.close()  # a loop that stops early ends the reader's thread (the leak check sees it)


def test_a_gpu_step_reads_its_next_batch_ahead_a_cpu_step_from_memory_does_not() -> None:
    """On an H200 the compiled GPT's step spent 12 ms of its 42 gathering its batch on the
    step's own thread (docs/gpu.md): a GPU job's batches are read one step ahead, on a thread,
    as a job reading from disk already was; a CPU job from memory keeps its core."""
    from types import SimpleNamespace

    from gradmesh.data.registry import Split
    from gradmesh.train.loop import reader

    split = Split(torch.arange(12).reshape(6, 2), torch.arange(6))

    def job(device: str, train: object = split) -> object:
        return SimpleNamespace(
            rt=SimpleNamespace(device=torch.device(device)), data=SimpleNamespace(train=train)
        )

    read, ahead = reader(job("cpu"))  # type: ignore[arg-type]
    assert not ahead and read(torch.tensor([4, 1])).y.tolist() == [4, 1]
    assert reader(job("cuda"))[1]  # type: ignore[arg-type]
    lazy = SimpleNamespace(lazy=True)
    assert reader(job("cpu", lazy))[1]  # type: ignore[arg-type]


def test_an_empty_tokens_pattern_is_one_line_not_the_working_directory() -> None:
    """`tokens:` with nothing after the colon once read every file of the working directory
    (Path("") is "."), failing on the first that was not a token file."""
    from gradmesh.data.tokens import corpus_files

    with pytest.raises(GradmeshError, match="dataset tokens: names no files: give a file, a glob"):
        corpus_files("")
