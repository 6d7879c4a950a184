"""A token file of 50M tokens (written here) feeding a 4-rank `gradmesh train` through
`--dataset tokens:`, killed mid-epoch and resumed: the resumed run reads the exact windows the
undisturbed one read after its checkpoint, so their weights end bit-equal (issue 61)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from gradmesh.data.tokens import write_tokens
from tests.integration.test_faults import final_state, train

TOKENS = 50_000_000
RUN = [
    "--model", "gpt", "--model-args", "dim=16,depth=1,heads=2", "--workers", "4",
    "--sequence-length", "32", "--batch-size", "16", "--max-steps", "8",
    "--optimizer", "adamw", "--lr", "0.003", "--checkpoint-every", "4",
]  # fmt: skip


def test_a_4_rank_run_on_50m_tokens_resumes_at_the_exact_next_window(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    data = write_tokens(tmp_path / "corpus.bin", rng.integers(0, 512, TOKENS, dtype=np.uint16))
    flags = [*RUN, "--dataset", f"tokens:{data}"]
    clean = train(
        *flags, "--checkpoint-dir", str(tmp_path / "a"), "--json", str(tmp_path / "a.json")
    )
    assert clean.returncode == 0, clean.stderr
    faulty = train(
        *flags, "--checkpoint-dir", str(tmp_path / "b"), "--json", str(tmp_path / "b.json"),
        "--max-restarts", "1", env={"GRADMESH_FAULT": "kill:2:6"},
    )  # fmt: skip
    assert faulty.returncode == 0, faulty.stderr
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    assert a["steps"] == 8 and b["faults"]["restarts"] == 1
    assert b["faults"]["resumed_from_step"] == 4  # mid-epoch: an epoch is 30,000+ steps
    assert b["loss_history"] == a["loss_history"]
    for mine, theirs in zip(final_state(tmp_path / "a"), final_state(tmp_path / "b"), strict=True):
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), name
