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

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = causal_mask(ids) if ids.is_meta else None
        logits: torch.Tensor = self.net(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return logits


def causal_mask(ids: torch.Tensor) -> torch.Tensor:
    """The causal mask of `ids` as the 4-D boolean tensor Hugging Face takes as given: what a
    forward on the meta device (the simulator's count) passes, since building the mask itself
    reads the position ids' values (a check for packed sequences), which meta tensors have
    none of. The same attention either way; the count sees the mask's bytes read as well."""
    batch, length = ids.shape
    rows = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
    return rows[None, None].expand(batch, 1, length, length)


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
