"""A GPT: token and position embeddings, pre-norm blocks of causal self-attention (one fused
q/k/v projection, optionally grouped-query) and an MLP, each with a residual, and an output head
tied to the token embedding. The shape people train, small enough for a CPU at the default size
(about 0.1M parameters) and as large as its arguments say (build it on the meta device to plan).

The model declares its own tensor-parallel plan (`GPT.tp_plan`, module names with wildcards,
see `gradmesh.layout.tensor.plan`), as Hugging Face models declare theirs: the vocabulary-parallel
embedding and the head tied to it, q/k/v split per chunk so each rank holds whole heads, the
attention's output and the MLP's second layer row-parallel.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.models.moe import MoE, MoEOutput, check_routing
from gradmesh.models.registry import MODELS, check_arg_kinds


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256
    seq: int = 64
    dim: int = 64
    depth: int = 2
    heads: int = 4
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0: as many as `heads`."""
    mlp_ratio: int = 4
    tie: bool = True
    experts: int = 0
    """Experts of each block's mixture (`gradmesh.models.moe`); 0: a plain MLP."""
    top_k: int = 2
    """Experts each token is routed to."""
    capacity: float = 0.0
    """Capacity factor of each expert (0: dropless routing)."""
    balance: float = 0.01
    """Weight of each mixture's balance loss."""

    def check(self) -> None:
        check_arg_kinds("gpt", typing.get_type_hints(GPTConfig), dataclasses.asdict(self))
        if self.experts:
            check_routing(self.experts, self.top_k, self.capacity)
        kv = self.kv_heads or self.heads
        if self.dim % self.heads or self.heads % kv:
            raise GradmeshError(
                f"gpt: dim {self.dim} must be a multiple of heads {self.heads}, and heads a "
                f"multiple of kv_heads {kv}"
            )


class Attention(nn.Module):
    """Causal self-attention; `heads` and `kv_heads` are the heads this module holds (a
    tensor-parallel plan divides them by tp)."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = c.heads, c.kv_heads or c.heads
        self.head_dim = c.dim // c.heads
        # no bias: a key bias only adds a constant to each query's scores, which softmax
        # ignores, so its gradient is rounding noise that Adam would amplify into steps
        self.qkv = nn.Linear(c.dim, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(self.heads * self.head_dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q = q.view(b, t, self.heads, d).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, d).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, d).transpose(1, 2)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, 1)
            v = v.repeat_interleave(self.heads // self.kv_heads, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.heads * d))  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c.dim, c.mlp_ratio * c.dim)
        self.fc2 = nn.Linear(c.mlp_ratio * c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(c.dim), Attention(c)
        self.ln2 = nn.LayerNorm(c.dim)
        self.mlp: nn.Module = (
            MoE(c.dim, c.mlp_ratio * c.dim, c.experts, c.top_k, c.capacity, c.balance)
            if c.experts
            else MLP(c)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class GPT(nn.Module):
    """Token ids (batch, time) -> logits (batch, time, vocab)."""

    def __init__(self, config: GPTConfig | None = None, **kwargs: int | bool) -> None:
        super().__init__()
        c = config or GPTConfig(**kwargs)  # type: ignore[arg-type]
        c.check()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.depth))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        for table in (self.tok, self.pos):  # GPT-2's scale: unit-variance rows, tied to the
            nn.init.normal_(table.weight, std=0.02)  # head, would start with huge logits
        if c.tie:
            self.head.weight = self.tok.weight

    @property
    def tp_plan(self) -> dict[str, str]:
        """Module name -> tensor-parallel style (`gradmesh.layout.tensor.plan`); the head gathers
        the logits (use `head: colwise` with a vocabulary-parallel loss to keep them split)."""
        kv = self.config.kv_heads or self.config.heads
        mlp = (
            {}
            if self.config.experts
            else {"blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"}
        )
        return {
            "tok": "embedding",
            "blocks.*.attn": "heads(heads,kv_heads)",
            "blocks.*.attn.qkv": f"colwise({self.config.heads},{kv},{kv})",
            "blocks.*.attn.proj": "rowwise",
            **mlp,  # a mixture's experts stay whole on every tp rank (ep places them)
            "head": "colwise(gather)",
        }

    @property
    def sp_plan(self) -> dict[str, str]:
        """`tp_plan` with sequence parallelism (`gradmesh.layout.tensor.sequence`): the blocks
        hold each tp rank's part of the sequence from the first block's input on; each norm
        runs on its part and all-gathers its output for the split layers after it, and the
        rowwise layers reduce-scatter their sums back to the parts."""
        return {
            **self.tp_plan,
            "blocks.0": "sequence(scatter)",
            "blocks.*.ln1": "sequence(gather)",
            "blocks.*.ln2": "sequence(gather)",
            "blocks.*.attn.proj": "rowwise(seq)",
            "blocks.*.mlp.fc2": "rowwise(seq)",
            "norm": "sequence(gather)",
        }

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor | MoEOutput:
        """Logits; with experts, the logits and the mixtures' balance losses (`MoEOutput`).
        `positions`: each token's place in its sequence (default 0, 1, ...; context
        parallelism gives each rank's chunks theirs)."""
        t = ids.shape[1]
        if positions is None:
            if t > self.config.seq:
                raise GradmeshError(
                    f"gpt: sequence of {t} tokens, longer than seq {self.config.seq}"
                )
            positions = torch.arange(t, device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        if not self.config.experts:
            return logits  # type: ignore[no-any-return]
        aux = [cast(MoE, block.mlp).aux_loss for block in self.blocks]
        return MoEOutput(logits, torch.stack(cast(list[torch.Tensor], aux)).sum())


def lm_loss(out: torch.Tensor | MoEOutput, target: torch.Tensor) -> torch.Tensor:
    """The language-model loss: cross-entropy of every position's next token, the mean over
    the batch's positions (gradmesh's loss convention, `gradmesh.layout.loss`; the engines add
    a mixture's balance losses)."""
    logits = out.logits if isinstance(out, MoEOutput) else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@MODELS.register("gpt")
def gpt(input_shape: tuple[int, ...], num_classes: int, **args: int | bool) -> GPT:
    """A GPT over a token dataset: its vocabulary and sequence length from the data, the rest
    from `--model-args` (dim, depth, heads, kv_heads, mlp_ratio, tie)."""
    if len(input_shape) != 1:
        raise GradmeshError(f"model gpt needs token sequences, got inputs of shape {input_shape}")
    return GPT(GPTConfig(vocab=num_classes, seq=input_shape[0], **args))  # type: ignore[arg-type]
