"""Hugging Face `transformers` causal language models, built from a config with random weights
(no download): `--model hf:llama --model-args hidden_size=64,num_hidden_layers=2,...`.

The model is wrapped so that its forward returns logits (what gradmesh's engines and losses
take), on the meta device too (`causal_mask`), and its declared tensor-parallel plan
(`_tp_plan`, Hugging Face's style names, which `gradmesh.layout.tensor.plan` reads as aliases of its
own) is the wrapper's `tp_plan`. Needs the optional `transformers` extra (`pip install
gradmesh[hf]`); `make test` installs it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.models.registry import MODELS


class CausalLM(nn.Module):
    """A Hugging Face causal LM whose forward gives the logits."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    @property
    def tp_plan(self) -> dict[str, str]:
        declared = dict(getattr(self.net, "_tp_plan", None) or {})
        if not declared:
            prefix = getattr(self.net, "base_model_prefix", "model")
            base = getattr(self.net.config, "base_model_tp_plan", None) or {}
            declared = {f"{prefix}.{k}": v for k, v in base.items()}
        return {f"net.{k}": v for k, v in declared.items()}

    @property
    def sp_plan(self) -> dict[str, str]:
        """`tp_plan` with sequence parallelism (as `GPT.sp_plan`): the decoder layers hold each
        tp rank's part of the sequence from the first layer's input on, each norm runs on its
        part and all-gathers its output for the split layers after it (the final norm for the
        head), and the rowwise layers reduce-scatter their sums back to the parts. Built from
        the declared plan and the first layer's modules named as norms."""
        from gradmesh.models.blocks import block_list

        plan = {k: "rowwise(seq)" if v == "rowwise" else v for k, v in self.tp_plan.items()}
        blocks = block_list(self)
        if not blocks:
            return plan
        first, prefix = blocks[0], blocks[0].rpartition(".")[0]
        plan[first] = "sequence(scatter)"
        for name, _ in self.get_submodule(first).named_modules():
            if name and name.rpartition(".")[2].endswith("norm"):
                plan[f"{prefix}.*.{name}"] = "sequence(gather)"
        outer = prefix.rpartition(".")[0]
        for name, _ in self.get_submodule(outer).named_children():
            if name.endswith("norm"):
                plan[f"{outer}.{name}"] = "sequence(gather)"
        return plan

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = causal_mask(ids) if ids.is_meta else None
        logits: torch.Tensor = self.net(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return logits


def causal_mask(ids: torch.Tensor) -> torch.Tensor:
    """The causal mask of `ids` as the 4-D boolean tensor Hugging Face takes as given: what a
    forward on the meta device (the simulator's count) passes, since building the mask itself
    reads the position ids' values (a check for packed sequences), which meta tensors have
    none of. It stands for Hugging Face's own causal flag, which a GPU's fused attention applies
    without a mask: made outside the counters that run (`TorchDispatchMode`s: FLOPs, bytes,
    live memory), so a count of a long sequence does not see S x S bytes no step moves."""
    from torch.utils._python_dispatch import _disable_current_modes

    batch, length = ids.shape
    with _disable_current_modes():
        rows = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        rows.gradmesh_causal = True  # type: ignore[attr-defined]
        return rows[None, None].expand(batch, 1, length, length)


def is_causal_mask(mask: Any) -> bool:
    """Whether `mask` is (a view of) one `causal_mask` made: the causal flag in a mask's form."""
    if not torch.is_tensor(mask):
        return False
    base = mask._base if mask._base is not None else mask
    return bool(getattr(base, "gradmesh_causal", False))


def build(kind: str) -> Any:
    """The builder of `hf:<kind>` (a model type Hugging Face knows: llama, mistral, qwen2, ...)."""

    def builder(input_shape: tuple[int, ...], num_classes: int, **args: Any) -> nn.Module:
        try:
            import transformers
        except ImportError:
            raise GradmeshError(
                f"model hf:{kind} needs the transformers extra: pip install 'gradmesh[hf]'"
            ) from None
        if len(input_shape) != 1:
            raise GradmeshError(f"model hf:{kind} needs token sequences, got {input_shape}")
        values = {"vocab_size": num_classes, "max_position_embeddings": input_shape[0], **args}
        try:
            config = transformers.AutoConfig.for_model(kind, **values)
        except ValueError as exc:
            raise GradmeshError(f"model hf:{kind}: {str(exc).splitlines()[0]}") from None
        auto = transformers.AutoModelForCausalLM
        net = auto.from_config(config, attn_implementation="sdpa")  # type: ignore[no-untyped-call]
        return CausalLM(net)

    return builder


MODELS.schemes["hf"] = build
