"""One context-parallel rank's attention, as torch's `context_parallel` ran it for torchtitan's
long-sequence Llama 3.1 8B rows, timed on one GPU (issue 60's known misses, docs/simulator.md).

    python3 scripts/cp_probe.py [--cp 1,2,4,8] [--tokens 32768] [--repeats 5] [--json FILE]

At 8 GPUs each rank of those rows holds 32,768 tokens at every sequence length (cp 1 at 32k to
cp 8 at 256k), so a rank's attention FLOPs grow with cp: one causal block on its own keys, then
cp - 1 half blocks (torch's load balancing: its two chunks against the first half of a lower
rank's keys, or its second chunk against a higher rank's whole). The published steps grow
faster than that from cp 2 to cp 4 and 8; the simulator, pricing the FLOPs, is 27-36 % fast
there. This probe runs one rank's share with torch's kernels and copies (read in torch's
`_context_parallel/_attention.py`: the aten flash kernels and their backward, keys and values
repeated to every head and all-gathered, the partial outputs merged in fp32 by their log-sum-exp
into new tensors, a half updated by a full-size `torch.cat`, backward against the merged output
with fp32 accumulators, a new fp32 key and value gradient buffer a step as the ring's receive
makes, and their concatenation to send on) with no other rank and no exchange: if its time a
step grows with cp, the cause is on the GPU (kernels, copies, the allocator) and this prices it;
if it stays flat, the cause is in the ring across GPUs (exchanges, ranks waiting on each other).

Printed: a table (cp, forward ms, backward ms, ms a ring step with the forward counted twice as
full recomputation runs it, against cp 1's, the allocator's retries) and the three kernel
shapes' TFLOP/s; the last line sums it up.
`--free-gib G` first fills the GPU to leave G GiB (the published runs reserved 84 of 95 GiB),
to see whether the ring's large buffers make the allocator free its cache and retry.

On the CPU (no GPU: the same work with the CPU's flash kernels, small shapes) it is what
tests/unit/test_cp_probe.py checks: every rank's merged output and gradients equal plain causal
attention over the whole sequence, so what the GPU times is the ring's whole work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def attend(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor, Any]:
    """The flash kernel torch's ring calls: output, log-sum-exp (fp32) and what backward needs."""
    if q.is_cuda:
        out, lse, *rest = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
        return out, lse, rest
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse, None


def attend_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, rest: Any
) -> tuple[Tensor, Tensor, Tensor]:
    if q.is_cuda:
        cum_q, cum_k, max_q, max_k, seed, offset, _ = rest
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset
        )
    else:
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal
        )
    return grads[0], grads[1], grads[2]


def step_blocks(rank: int, step: int, q: Tensor, k: Tensor, v: Tensor) -> tuple[Any, ...]:
    """What rank `rank` computes at ring step `step` with the keys of rank (rank - step):
    (q, k, v, causal, where in q) as torch's load-balanced ring picks them."""
    half = q.shape[2] // 2
    if step == 0:
        return q, k, v, True, slice(None)
    if step <= rank:  # a lower rank's keys: the first of its two chunks, for both of ours
        return q, k[:, :, :half], v[:, :, :half], False, slice(None)
    return q[:, :, half:], k, v, False, slice(half, None)  # a higher rank's: our second chunk


def wide(t: Tensor) -> torch.dtype:
    """The accumulators' dtype: fp32 (torch's ring's), or the inputs' where wider."""
    return torch.promote_types(t.dtype, torch.float32)


def _with_half(whole: Tensor, half: Tensor, second: bool, add: bool) -> Tensor:
    """A new tensor: `whole` with its first or second half along the sequence replaced by (or
    added to) `half`, as torch's ring's `_partial_update` makes it (a full-size copy)."""
    parts = list(whole.chunk(2, dim=2))
    parts[int(second)] = parts[int(second)] + half if add else half
    return torch.cat(parts, dim=2)


def ring_forward(rank: int, q: Tensor, kv: list[tuple[Tensor, Tensor]]) -> tuple[Any, ...]:
    """One rank's output and log-sum-exp over every rank's keys (`kv[s]`: rank s's), merged in
    fp32 step by step as torch's ring merges (new tensors, not in place):
    out - sigmoid(lse_b - lse) (out - out_b) and lse - logsigmoid(lse - lse_b)."""
    cp = len(kv)
    out = lse = None
    saved = []
    for step in range(cp):
        k, v = kv[(rank - step) % cp]
        qq, kk, vv, causal, rows = step_blocks(rank, step, q, k, v)
        block, block_lse, rest = attend(qq, kk, vv, causal)
        saved.append(rest)
        block_lse = block_lse.unsqueeze(-1)
        if out is None or lse is None:
            out, lse = block.to(wide(q)), block_lse
            continue
        part_out, part_lse = out[:, :, rows], lse[:, :, rows]
        new_out = part_out - torch.sigmoid(block_lse - part_lse) * (part_out - block)
        new_lse = part_lse - F.logsigmoid(part_lse - block_lse)
        if rows == slice(None):
            out, lse = new_out, new_lse
        else:
            out = _with_half(out, new_out, second=True, add=False)
            lse = _with_half(lse, new_lse, second=True, add=False)
    assert out is not None and lse is not None
    return out.to(q.dtype), lse.squeeze(-1), saved


def ring_backward(
    rank: int, q: Tensor, kv: list[tuple[Tensor, Tensor]], out: Tensor, lse: Tensor,
    dout: Tensor, saved: list[Any], dkv: Callable[[int], tuple[Tensor, Tensor]],
) -> Tensor:  # fmt: skip
    """One rank's query gradient (fp32), and each visiting block's key and value gradients
    added into `dkv(source)` (fp32, the buffers that arrive with the block): backward against
    the merged output, with torch's ring's copies (a half added by a full-size copy, the
    key and value gradients concatenated to be sent on)."""
    cp = len(kv)
    dq = torch.zeros(q.shape, dtype=wide(q), device=q.device)
    for step in range(cp):
        source = (rank - step) % cp
        k, v = kv[source]
        qq, kk, vv, causal, rows = step_blocks(rank, step, q, k, v)
        grads = attend_backward(
            dout[:, :, rows],
            qq,
            kk,
            vv,
            out[:, :, rows],
            lse[:, :, rows].contiguous(),
            causal,
            saved[step],
        )
        if rows == slice(None):
            dq += grads[0]
        else:  # our second chunk only
            dq = _with_half(dq, grads[0], second=True, add=True)
        dk, dv = dkv(source)
        if kk.shape[2] == k.shape[2]:
            dk += grads[1]
            dv += grads[2]
        else:  # the first half of a lower rank's keys
            # (copied back into the buffers `dkv` gave: one copy more than torch's, which keeps
            # the new tensor)
            dk.copy_(_with_half(dk, grads[1], second=False, add=True))
            dv.copy_(_with_half(dv, grads[2], second=False, add=True))
        torch.cat([dk.flatten(), dv.flatten()])  # what the ring sends on (dropped here)
    return dq


def chunked(whole: Tensor, cp: int) -> list[Tensor]:
    """Each rank's tokens of a (B, H, S, D) sequence cut in 2 cp chunks: rank r holds chunks r
    and 2 cp - 1 - r (torch's load balancing)."""
    chunks = whole.chunk(2 * cp, dim=2)
    return [torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=2) for r in range(cp)]


def _time(cuda: bool, work: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """`work(*args)`'s seconds (the GPU's work done) and its result."""
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = work(*args)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started, result


def probe(cp: int, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The median forward and backward of ranks 0 and cp - 1 at `cp`: every off-diagonal step
    of rank 0 is a higher rank's keys (its second chunk against them), every one of rank cp - 1
    a lower rank's (both chunks against their first half). Every rank has the same FLOPs; at
    each step of the ring both kinds run, so the ring goes at the slower rank's pace."""
    shape = (1, args.heads, args.tokens, args.head_dim)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, dout = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
    gathered = torch.randn((cp, 2, *shape), device=device, dtype=dtype)  # the all-gather's
    kv = [(gathered[s, 0], gathered[s, 1]) for s in range(cp)]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    retries = _retries(device)

    def fresh(_source: int) -> tuple[Tensor, Tensor]:  # the ring's receive: new fp32 buffers
        zeros = torch.zeros(shape, dtype=torch.float32, device=device)
        return zeros, torch.zeros_like(zeros)

    row: dict[str, Any] = {"cp": cp}
    for rank in sorted({0, cp - 1}):
        forward, backward = [], []
        for _ in range(args.repeats + 1):  # the first is the warm-up
            seconds, (out, lse, saved) = _time(cuda, ring_forward, rank, q, kv)
            forward.append(seconds)
            seconds, _ = _time(cuda, ring_backward, rank, q, kv, out, lse, dout, saved, fresh)
            backward.append(seconds)
        fwd, bwd = statistics.median(forward[1:]), statistics.median(backward[1:])
        row[f"rank{rank}"] = {"forward_ms": fwd * 1e3, "backward_ms": bwd * 1e3}
    ranks = [row[f"rank{r}"] for r in sorted({0, cp - 1})]
    row["forward_ms"] = max(r["forward_ms"] for r in ranks)
    row["backward_ms"] = max(r["backward_ms"] for r in ranks)
    row["ms_a_step"] = (2 * row["forward_ms"] + row["backward_ms"]) / cp  # recomputed forward
    row["alloc_retries"] = _retries(device) - retries
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    return row


def _retries(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def kernel_rates(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """TFLOP/s of the three block shapes a ring step runs (forward and backward, backward
    counted as 2.5 forwards: flash's five products against two), medians of `repeats`."""
    t, half = args.tokens, args.tokens // 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = {"own keys, causal": (t, t, True), "lower rank's first half": (t, half, False)}
    shapes["higher rank's, our second half"] = (half, t, False)
    rates = {}
    for name, (rows, keys, causal) in shapes.items():
        q = torch.randn(1, args.heads, rows, args.head_dim, device=device, dtype=dtype)
        k, v = (
            torch.randn(1, args.heads, keys, args.head_dim, device=device, dtype=dtype)
            for _ in range(2)
        )
        times = [
            _time(device.type == "cuda", _both, q, k, v, causal)[0] for _ in range(args.repeats + 1)
        ]
        seconds = statistics.median(times[1:])  # the first is the warm-up
        pairs = rows * keys / (2 if causal else 1)
        rates[name] = 3.5 * 4 * pairs * args.head_dim * args.heads / seconds / 1e12
    return rates


def _both(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> None:
    out, lse, rest = attend(q, k, v, causal)
    attend_backward(out, q, k, v, out, lse, causal, rest)


def fill(free_gib: float) -> Tensor | None:
    """Hold all but `free_gib` GiB of the GPU (None where it is already that full)."""
    free, _ = torch.cuda.mem_get_info()
    extra = free - int(free_gib * 2**30)
    return torch.empty(extra, dtype=torch.uint8, device="cuda") if extra > 0 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", default="1,2,4,8", help="cp degrees, comma-separated")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens a rank holds")
    parser.add_argument("--heads", type=int, default=32, help="attention heads (keys repeated)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs after a warm-up")
    parser.add_argument("--free-gib", type=float, default=None, help="leave only this free")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and args.tokens > 4096:
        print("cp_probe: no GPU: give --tokens 4096 or fewer on a CPU", file=sys.stderr)
        return 2
    held = fill(args.free_gib) if args.free_gib is not None and device.type == "cuda" else None
    rows = [probe(int(c), args, device) for c in args.cp.split(",")]
    rates = kernel_rates(args, device)
    base = rows[0]["ms_a_step"]
    print("| cp | forward ms | backward ms | ms a ring step | against the first | alloc retries |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["against_first"] = r["ms_a_step"] / base
        print(
            f"| {r['cp']} | {r['forward_ms']:.1f} | {r['backward_ms']:.1f} | "
            f"{r['ms_a_step']:.1f} | {r['against_first']:.2f}x | {r['alloc_retries']} |"
        )
    for name, rate in rates.items():
        print(f"{name}: {rate:.3g} TFLOP/s (forward and backward)")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": name,
                    "torch": torch.__version__,
                    "rows": rows,
                    "kernel_tflops": rates,
                    "held_gib": 0 if held is None else held.numel() / 2**30,
                },
                f,
                indent=1,
            )
    steps = "/".join(f"{r['against_first']:.2f}" for r in rows)
    print(f"a ring step's time against cp {rows[0]['cp']}'s: {steps}x (cp {args.cp}) on {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
