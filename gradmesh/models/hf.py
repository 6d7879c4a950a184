"""Hugging Face `transformers` causal language models, built from a config with random weights
(no download): `--model hf:llama --model-args hidden_size=64,num_hidden_layers=2,...`; or from
a local pretrained model directory (`--model hf:PATH`, as `save_pretrained` writes it: its
`config.json` and safetensors): the model is then built with its parameters on the meta device
(`empty_parameters`; buffers are made for real, as a model's own code computes them) and each
rank reads only its part of the weights once the layout has cut it
(`gradmesh.train.pretrained`).

The model is wrapped so that its forward returns logits (what gradmesh's engines and losses
take), on the meta device too (`causal_mask`), and its declared tensor-parallel plan
(`_tp_plan`, Hugging Face's style names, which `gradmesh.layout.tensor.plan` reads as aliases of its
own) is the wrapper's `tp_plan`. Needs the optional `transformers` extra (`pip install
gradmesh[hf]`); `make test` installs it.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.models.quiet import torchao_quiet
from gradmesh.models.registry import MODELS


class CausalLM(nn.Module):
    """A Hugging Face causal LM whose forward gives the logits."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    @property
    def tp_plan(self) -> dict[str, str]:
        """The model's declared plan, with the input embedding as transformers 5.24 declares
        it whatever release is installed: split by vocabulary rows where a plan is declared
        and the base model's `embed_tokens` is an `nn.Embedding` (5.17 left Llama's whole, and
        the same model was a different split on another machine); whole where it is a
        subclass with a forward of its own (Gemma's scales its rows), which a split would lose.
        """
        prefix = getattr(self.net, "base_model_prefix", "model")
        declared = dict(getattr(self.net, "_tp_plan", None) or {})
        if not declared:
            base = getattr(self.net.config, "base_model_tp_plan", None) or {}
            declared = {f"{prefix}.{k}": v for k, v in base.items()}
        table, name = getattr(self.net.base_model, "embed_tokens", None), f"{prefix}.embed_tokens"
        if type(table) is nn.Embedding and declared:
            declared.setdefault(name, "embedding_rowwise")
        elif isinstance(table, nn.Embedding):  # a subclass: whole
            declared.pop(name, None)
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


WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def is_directory(kind: str) -> bool:
    """Whether `hf:<kind>` names a model directory (a path) rather than a model type."""
    return "/" in kind or Path(kind).is_dir()


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Which safetensors file of a pretrained `directory` holds each tensor (one file, or the
    shards its index names); one line where it holds none."""
    root = Path(directory)
    if (root / INDEX).is_file():
        try:
            mapping = json.loads((root / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise GradmeshError(f"weights {directory}: {INDEX} is unreadable: {exc}") from None
        missing = sorted({f for f in mapping.values() if not (root / f).is_file()})
        if missing:
            raise GradmeshError(f"weights {directory}: {INDEX} names {missing[0]}, not there")
        return {name: root / file for name, file in mapping.items()}
    if (root / WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(str(root / WEIGHTS), framework="pt") as f:
            return dict.fromkeys(f.keys(), root / WEIGHTS)
    pickled = (root / "pytorch_model.bin").exists()
    other = "; pytorch_model.bin is not read (pickle)" if pickled else ""
    raise GradmeshError(f"weights {directory}: no {WEIGHTS} or {INDEX} there{other}")


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Modules made inside hold their parameters on the meta device (no memory, no values),
    their buffers for real: each parameter is made as its module's code makes it, then moved
    (one tensor at a time: the peak is the largest). What `accelerate.init_empty_weights`
    does; written here so that loading needs no accelerate."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            made = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = made

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _transformers(name: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise GradmeshError(
            f"model hf:{name} needs the transformers extra: pip install 'gradmesh[hf]'"
        ) from None
    return transformers


def pretrained_config(directory: str) -> Any:
    """The Hugging Face config of a model directory; one line where there is none."""
    transformers = _transformers(directory)
    if not Path(directory).is_dir():
        raise GradmeshError(f"model hf:{directory}: no such directory")
    try:
        return transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise GradmeshError(f"model hf:{directory}: {str(exc).splitlines()[0]}") from None


def _pretrained(directory: str, num_classes: int, args: dict[str, Any]) -> nn.Module:
    """A pretrained model's skeleton: its config's model with parameters on the meta device,
    `pretrained` naming where its weights are (read once the layout has cut it)."""
    config = pretrained_config(directory)
    files = weight_files(directory)  # one line now, before launch, where there are none
    if args:
        raise GradmeshError(
            f"model hf:{directory}: --model-args {','.join(args)} cannot change a pretrained "
            "model (its config.json is its shape)"
        )
    if num_classes > config.vocab_size:
        raise GradmeshError(
            f"the data holds tokens past the vocabulary of model hf:{directory}: ids up to "
            f"{num_classes - 1}, and it has {config.vocab_size}"
        )
    auto = _transformers(directory).AutoModelForCausalLM
    with empty_parameters(), torchao_quiet():
        net = auto.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model = CausalLM(net)
    model.pretrained = directory  # type: ignore[assignment]
    model.file_names = file_names(net, files)  # type: ignore[assignment]
    return model


def file_names(net: nn.Module, keys: Iterable[str]) -> dict[str, str]:
    """Each tensor of the files under the name the model holds it by: Hugging Face renames
    some when it loads (`get_model_conversion_mapping`'s renamings: GPT-NeoX's `embed_out`
    is the model's `lm_head`), and `save_pretrained` renames them back."""
    import transformers.modeling_utils as hf_modeling

    mapping = getattr(hf_modeling, "get_model_conversion_mapping", None)
    if mapping is None:  # a transformers without renamings: the names are the model's
        return {key: key for key in keys}
    renames = [
        (re.compile(source), target)
        for weight in mapping(net)
        if type(weight).__name__ == "WeightRenaming"
        for source, target in zip(weight.source_patterns, weight.target_patterns, strict=False)
    ]
    found = {}
    for key in keys:
        name = key
        for pattern, target in renames:
            name = pattern.sub(target, name)
        found[name] = key
    return found


def pretrained_source(model: nn.Module) -> str | None:
    """The directory whose weights `model` (a pretrained skeleton) is to read; None otherwise."""
    found = getattr(model, "pretrained", None)
    return found if isinstance(found, str) else None


def build(kind: str) -> Any:
    """The builder of `hf:<kind>` (a model type Hugging Face knows: llama, mistral, qwen2, ...;
    or a pretrained model's directory)."""

    def builder(input_shape: tuple[int, ...], num_classes: int, **args: Any) -> nn.Module:
        transformers = _transformers(kind)
        if len(input_shape) != 1:
            raise GradmeshError(f"model hf:{kind} needs token sequences, got {input_shape}")
        if is_directory(kind):
            return _pretrained(kind, num_classes, args)
        if kind not in transformers.CONFIG_MAPPING:
            raise GradmeshError(
                f"model hf:{kind}: not a model type transformers {transformers.__version__} "
                "knows (llama, mistral, qwen2, gpt2, ...), nor a model's directory"
            )
        values = {"vocab_size": num_classes, "max_position_embeddings": input_shape[0], **args}
        try:
            config = transformers.AutoConfig.for_model(kind, **values)
        except Exception as exc:  # noqa: BLE001 - configs refuse values with ValueError, TypeError or huggingface_hub's own validation error
            why = " ".join(line.strip() for line in str(exc).splitlines()[:2])
            raise GradmeshError(f"model hf:{kind}: {why}") from None
        auto = transformers.AutoModelForCausalLM
        with torchao_quiet():
            net = auto.from_config(config, attn_implementation="sdpa")
        return CausalLM(net)

    return builder


MODELS.schemes["hf"] = build
