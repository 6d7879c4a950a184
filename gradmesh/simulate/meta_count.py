"""What the simulator counts of a token model on the meta device (`Spec`, `count`): rank 0's
slice at a tp degree run once forward and backward on one sample, its kernels, tp exchanges,
saved activations and parameters; and a deep model of alike blocks counted at 2 and 3 blocks
and extrapolated (`repeated`), so a 96-block model costs what a 3-block one does. The formulas
that use the counts are `gradmesh.simulate.mesh`'s."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Spec:
    """A model to build on the meta device, and what it trains with."""

    model: str
    args: dict[str, Any]
    sequence: int
    vocab: int
    precision: str
    optimizer: str = "adamw"

    @property
    def mixed(self) -> bool:
        return self.precision in ("bf16", "fp16")

    def build(self) -> tuple[Any, Any]:
        """(the model on the meta device in the job's precision, one sample's token ids)."""
        import torch

        from gradmesh.models.registry import MODELS

        builder = MODELS.get(self.model)  # first: the lookup loads the registry, schemes too
        with torch.device("meta"):
            if ":" in self.model and self.model.partition(":")[0] not in MODELS.schemes:
                net = builder(**self.args)
            else:
                net = builder((self.sequence,), self.vocab, **self.args)
            if self.mixed:
                net = net.to(torch.bfloat16)
            ids = torch.zeros(1, self.sequence, dtype=torch.long, device="meta")
        return net, ids


@dataclass(frozen=True)
class Counted:
    """Rank 0's slice at one tp, counted on the meta device at one sample."""

    kernels: list[tuple[str, float, float]]
    exchanges: list[tuple[int, str]]
    saved: Any
    block_param_bytes: dict[str, int]
    rest_param_bytes: int
    parameters: float
    flops: float
    """Forward and backward FLOPs of the slice."""


def count(spec: Spec, tp: int) -> Counted:
    """The module docstring's counts of rank 0's slice at tp."""
    from gradmesh.layout.config import LayoutConfig
    from gradmesh.layout.memory import saved_activations
    from gradmesh.layout.tensor.layers import dry_exchanges
    from gradmesh.models.blocks import block_list
    from gradmesh.models.flops import KernelCounter, scalar_of
    from gradmesh.train.recipe import rank_slice

    net, ids = spec.build()
    net = rank_slice(net, LayoutConfig(tensor_parallel=tp), spec.model)  # the recipe's slice
    counter = KernelCounter()
    with dry_exchanges(tp) as dry:
        with counter:
            scalar_of(net(ids)).backward()  # type: ignore[no-untyped-call]
        made = [(n, kind) for _, n, kind in dry.made]
    with dry_exchanges(tp):
        saved = saved_activations(net, lambda: scalar_of(net(ids)), ids, peak=False)
    kernels = [(k, f, b) for costs in counter.costs.values() for k, (f, b) in costs.items()]
    names = block_list(net)
    per_block = dict.fromkeys(names, 0)
    rest = 0
    for name, p in net.named_parameters():
        owner = next((b for b in names if name.startswith(b + ".")), None)
        if owner is None:
            rest += p.numel() * p.element_size()
        else:
            per_block[owner] += p.numel() * p.element_size()
    params = sum(p.numel() for p in net.parameters())
    return Counted(kernels, made, saved, per_block, rest, params, counter.useful)


DEPTH_ARGS = ("depth", "num_hidden_layers", "n_layer")
"""The arguments that give a model's number of alike blocks: gradmesh's `gpt` and a factory's
(`depth`), Hugging Face's (most models; GPT-2's)."""


def deep(spec: Spec) -> int:
    """The depth `spec` is extrapolated to from depths 2 and 3 (`repeated`), or 0 to count it
    whole: a model given more than 3 blocks by one of `DEPTH_ARGS`."""
    depth = next((spec.args[k] for k in DEPTH_ARGS if k in spec.args), None)
    return depth if isinstance(depth, int) and depth > 3 else 0


def at_depth(spec: Spec, depth: int) -> Spec:
    """`spec` with `depth` blocks (the `DEPTH_ARGS` argument it is given)."""
    key = next(k for k in DEPTH_ARGS if k in spec.args)
    return dataclasses.replace(spec, args={**spec.args, key: depth})


def renamed(names: list[str], depth: int) -> list[str] | None:
    """The block names of `depth` blocks, from those of 3 named `prefix.0` .. `prefix.2`."""
    prefix = names[0].rpartition(".")[0]
    if names != [f"{prefix}.{i}" for i in range(len(names))]:
        return None
    return [f"{prefix}.{i}" for i in range(depth)]


def grown(table: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A per-block table of 3 blocks for all of `names`: the first and last blocks' own
    values (they carry what comes before and after the blocks), the middle one's between."""
    first, middle, last = table.values()
    return {
        n: first if i == 0 else last if i == len(names) - 1 else middle for i, n in enumerate(names)
    }


def repeated(two: Counted, three: Counted, depth: int, names: list[str]) -> Counted:
    """A model of `depth` identical blocks counted from the same model at 2 and 3 blocks:
    every total grows by the third block's share once per block more."""
    more = depth - 2

    def grow(a: float, b: float) -> float:
        return a + more * (b - a)

    kinds: dict[str, list[float]] = {}
    for sign, counted in ((-1, two), (1, three)):
        for kind, f, b in counted.kernels:
            k = kinds.setdefault(kind, [0.0, 0.0, 0.0, 0.0])
            k[0 if sign < 0 else 2] += f
            k[1 if sign < 0 else 3] += b
    kernels = [(k, grow(v[0], v[2]), grow(v[1], v[3])) for k, v in kinds.items()]
    extra = Counter(three.exchanges) - Counter(two.exchanges)
    exchanges = list(
        (Counter(two.exchanges) + Counter({e: more * n for e, n in extra.items()})).elements()
    )
    saved = dataclasses.replace(
        three.saved,
        blocks=grown(three.saved.blocks, names),
        inputs=grown(three.saved.inputs, names),
        kept=grown(three.saved.kept, names),
    )
    return Counted(
        kernels,
        exchanges,
        saved,
        grown(three.block_param_bytes, names),
        three.rest_param_bytes,
        grow(two.parameters, three.parameters),
        grow(two.flops, three.flops),
    )
