"""Vocabulary parallelism: an embedding table and the language-model loss split by vocabulary
rows over the mesh's `tp` axis, so neither the table nor the full logits live on one rank.

`VocabParallelEmbedding` holds rows [start, end) of the table (the `index`-th of `parts` equal
pieces, DTensor's `Shard(0)`): each rank looks up the ids it holds, zeros for the others, and
one allreduce over tp makes the whole embedding (backward: identity, each rank's rows take the
gradient of their own ids). An output head tied to the embedding and split colwise holds the
same rows, so the tied weight stays one parameter, sharded the same way on both uses.

`vocab_parallel_cross_entropy(local_logits, target)` is cross-entropy on logits whose last
dimension is this rank's slice of the vocabulary (a colwise head that does not gather): the
maximum is reduced over tp (max), then the sum of exponentials and the target's logit in one
allreduce (sum), so a step moves 3 numbers per token instead of the whole vocabulary's logits.
Its backward is the local softmax minus the one-hot target, with no communication. This is
Megatron-LM's construction; DTensor's `loss_parallel` does the same on DTensors, which the
rest of gradmesh's layers do not use (see `gradmesh.layout.tensor.layers`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradmesh.layout.tensor.layers import _tp_collective, reduce_from_tp, shard, tp_place


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of an `nn.Embedding`; forward gives the whole embedding of any ids."""

    def __init__(
        self, layer: nn.Embedding, parts: int, index: int, weight: nn.Parameter | None = None
    ) -> None:
        super().__init__()
        rows = layer.num_embeddings // parts
        self.start, self.end = index * rows, (index + 1) * rows
        self.weight = (
            weight if weight is not None else nn.Parameter(shard(layer.weight, 0, parts, index))
        )
        self.num_embeddings, self.embedding_dim = layer.num_embeddings, layer.embedding_dim
        """The replaced embedding's: forward takes any id of the whole vocabulary."""
        self.padding_idx: int | None = None
        if layer.padding_idx is not None and self.start <= layer.padding_idx < self.end:
            self.padding_idx = layer.padding_idx - self.start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight, self.padding_idx)
        return reduce_from_tp(out * mine.unsqueeze(-1).to(out.dtype))

    def extra_repr(self) -> str:
        return f"vocabulary rows [{self.start}, {self.end}), width {self.weight.shape[1]}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int
    ) -> torch.Tensor:
        vocab = logits.shape[-1]
        start = tp_place()[1] * vocab
        flat = logits.reshape(-1, vocab)
        if flat.dtype in (torch.float16, torch.bfloat16):  # the softmax sums in float32
            flat = flat.float()
        target = target.reshape(-1)
        top = _tp_collective(flat.max(-1).values.detach().clone(), "loss maximum", "max")
        shifted = flat - top.unsqueeze(-1)
        mine = (target >= start) & (target < start + vocab)
        local = torch.where(mine, target - start, torch.zeros_like(target))
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine
        exp = shifted.exp_()  # in place: the shifted logits are not read again (a vocab-sized
        sums = _tp_collective(torch.stack([exp.sum(-1), picked]), "loss sums")  # copy fewer)
        keep = target != ignore_index
        loss = (sums[0].log() - sums[1]) * keep
        ctx.save_for_backward(exp / sums[0].unsqueeze(-1), local, mine & keep, keep)
        ctx.shape = logits.shape
        ctx.dtype = logits.dtype
        return loss.reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        softmax, local, hit, keep = ctx.saved_tensors
        g = softmax * keep.unsqueeze(-1)
        g.scatter_add_(-1, local.unsqueeze(-1), -hit.to(g.dtype).unsqueeze(-1))
        g = g * grad.reshape(-1, 1)
        return g.reshape(ctx.shape).to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token cross-entropy (shape of `target`; 0 where target is `ignore_index`) of logits
    split over tp by vocabulary (this rank's slice last). On a mesh with tp 1 it is
    `F.cross_entropy(..., reduction="none")`."""
    if tp_place()[0] == 1:
        flat = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            target.reshape(-1),
            ignore_index=ignore_index,
            reduction="none",
        )
        return flat.reshape(target.shape)
    return _VocabParallelCrossEntropy.apply(  # type: ignore[no-untyped-call,no-any-return]
        logits, target, ignore_index
    )
