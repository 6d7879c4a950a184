"""gradmesh bench loader: how many tokens a second `--dataset tokens:` feeds one rank from one
core, against how many the GPT trains on at once on this machine, measured in the same run.

A token file of `--tokens` random tokens (uint16, vocabulary 256) is written to a temporary
folder (or `--file` is read), and each round times, interleaved and in turn order rotated:
- the loader: one rank of `--ranks` reading `--batches` of its global-batch slices (the
  sharder's seeded order, `TokenSplit.rows`: the gathers from the memory map), on one thread
  (`torch.set_num_threads(1)`); the page cache is warm after the first round, as it is in a
  run that has read the file once (the first round is the warm-up);
- the GPT's training: forward, backward and AdamW on batches of the same shape (the trainer's
  default GPT, or `--model-args`), on every core.
The figures are medians over the rounds after the first; the ratio is the one that must stay
large for the loader never to be the bottleneck (issue 61 asks 10x).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradmesh.bench.harness import CPU_BOUND_IDLE, interleaved, report
from gradmesh.errors import GradmeshError
from gradmesh.options import option, refuse_unread
from gradmesh.runtime.process import cpu_jiffies, idle_since


@dataclass
class Config:
    """gradmesh bench loader: tokens/s the token loader feeds one rank from one core, against
    the GPT's training tokens/s"""

    tokens: int = option(50_000_000, "tokens in the file written for the benchmark", at_least=1)
    file: str | None = option(None, "read this token file (or glob) instead of writing one")
    sequence: int = option(64, "tokens per sample (train's --sequence-length default)", at_least=1)
    batch: int = option(64, "global batch (train's --batch-size default)", at_least=1)
    ranks: int = option(4, "data-parallel ranks the batch is split over (one is timed)", at_least=1)
    batches: int = option(200, "batches each loader turn reads", at_least=1)
    steps: int = option(5, "training steps each training turn takes", at_least=1)
    model_args: str = option("", "the GPT's --model-args")
    rounds: int = option(5, "rounds (the first warms up)", at_least=1)
    json: str | None = option(None, "write the result here")


def _loader_turn(spec: Any, args: Config, epoch: int) -> float:
    import torch

    from gradmesh.data.sharding import GlobalBatchSharder

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sharder = GlobalBatchSharder(len(spec.train), args.batch, 0, args.ranks, seed=epoch)
    try:
        started, tokens = time.perf_counter(), 0
        for k, (indices, _) in enumerate(sharder.batches(epoch)):
            if k == args.batches:
                break
            tokens += spec.train.rows(indices).x.numel()
        return tokens / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)


def _trainer(spec: Any, args: Config) -> Any:
    import torch

    from gradmesh.models.gpt import lm_loss
    from gradmesh.models.registry import build_model
    from gradmesh.registry import parse_kwargs

    torch.manual_seed(0)
    model = build_model("gpt", spec, parse_kwargs(args.model_args, "--model-args"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    part = spec.train.rows(torch.arange(args.batch, device="cpu"))

    def turn() -> float:
        started = time.perf_counter()
        for _ in range(args.steps):
            optimizer.zero_grad()
            lm_loss(model(part.x), part.y).backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        return float(args.steps * part.x.numel() / (time.perf_counter() - started))

    return turn


def run(args: Config, _command: list[str] | None = None) -> int:
    import numpy as np

    from gradmesh.data.registry import DataOptions
    from gradmesh.data.tokens import load_tokens, write_tokens

    if min(args.rounds, args.batches, args.steps, args.ranks, args.tokens) < 1 or args.rounds < 2:
        raise GradmeshError("--rounds must be >= 2 and the other counts >= 1")
    if args.file:
        refuse_unread(args, ("tokens",), "the size of the file written when no --file is given")
    with tempfile.TemporaryDirectory(prefix="gradmesh-loader-") as tmp:
        pattern = args.file
        if pattern is None:
            rng = np.random.default_rng(0)
            pattern = str(write_tokens(Path(tmp) / "tokens.bin", rng.integers(0, 256, args.tokens)))
        spec = load_tokens(pattern, DataOptions(sequence=args.sequence))
        train = _trainer(spec, args)
        rates: dict[str, list[float]] = {"loader": [], "train": []}
        before = cpu_jiffies()
        for round_, kind in interleaved(["loader", "train"], args.rounds):
            rate = _loader_turn(spec, args, round_) if kind == "loader" else train()
            if round_:  # the first round warms up (page cache, allocator)
                rates[kind].append(rate)
        idle = idle_since(before)
    loader, trained = (statistics.median(rates[k]) for k in ("loader", "train"))
    payload = {
        "file": args.file or f"{args.tokens} random uint16 tokens (written for the run)",
        "windows": len(spec.train),
        "sequence": args.sequence,
        "batch": args.batch,
        "ranks": args.ranks,
        "loader_tokens_per_s": loader,
        "train_tokens_per_s": trained,
        "ratio": loader / trained,
        "loader_rounds": rates["loader"],
        "train_rounds": rates["train"],
        "cpu_idle": idle,
        "limit": "cpu" if idle < CPU_BOUND_IDLE else "not cpu",
    }
    return report(
        args.json,
        payload,
        [
            f"loader: {loader:,.0f} tokens/s on one core (one rank of {args.ranks}, batch "
            f"{args.batch} x {args.sequence}); the GPT trains {trained:,.0f} tokens/s: "
            f"{loader / trained:.0f}x (medians of {args.rounds - 1} rounds; idle CPU {idle:.0%})"
        ],
    )
