"""scripts/cp_probe.py times one rank of torch's load-balanced ring on a GPU (issue 60); here,
on the CPU's flash kernels, its ring is checked to be the whole of causal attention: every
rank's merged output and its gradients, summed over the ranks as the ring sends them home,
equal plain causal attention over the sequence. A wrong half, step or merge fails it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from tests.harness import SCRIPTS, script

SCRIPT = SCRIPTS / "cp_probe.py"


@pytest.fixture(scope="module")
def probe() -> Iterator[ModuleType]:
    with script("cp_probe") as module:
        yield module


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_ring_of_every_rank_is_causal_attention_over_the_sequence(
    probe: ModuleType, cp: int
) -> None:
    torch.manual_seed(cp)
    shape = (1, 2, 16 * cp, 8)  # 2 cp chunks of 8 tokens
    q, k, v, dout = (torch.randn(shape, dtype=torch.float64) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    whole = F.scaled_dot_product_attention(*leaves, is_causal=True)
    whole.backward(dout)
    qs, ks, vs, douts = (probe.chunked(t, cp) for t in (q, k, v, dout))
    kv = list(zip(ks, vs, strict=True))
    dk, dv = [torch.zeros_like(t) for t in ks], [torch.zeros_like(t) for t in vs]
    outs, dqs = [], []
    for rank in range(cp):
        out, lse, saved = probe.ring_forward(rank, qs[rank], kv)
        outs.append(out)
        dqs.append(
            probe.ring_backward(
                rank, qs[rank], kv, out, lse, douts[rank], saved, lambda s: (dk[s], dv[s])
            )
        )
    torch.testing.assert_close(torch.stack(outs), torch.stack(probe.chunked(whole.detach(), cp)))
    for got, leaf in zip((dqs, dk, dv), leaves, strict=True):
        assert leaf.grad is not None
        torch.testing.assert_close(torch.stack(got), torch.stack(probe.chunked(leaf.grad, cp)))


def test_on_the_cpu_it_runs_small_and_refuses_a_gpu_s_size_in_a_line(tmp_path: Path) -> None:
    small = [sys.executable, str(SCRIPT), "--cp", "1,2", "--tokens", "256", "--heads", "2"]
    small += ["--head-dim", "16", "--repeats", "1", "--json", str(tmp_path / "p.json")]
    cpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU's path, on a GPU's host too
    done = subprocess.run(small, capture_output=True, text=True, timeout=120, env=cpu)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("a ring step's time against cp 1's: 1.00/")
    big = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120, env=cpu
    )
    assert big.returncode == 2 and big.stderr.count("\n") == 1, big.stderr
