"""What the simulator counts of a token model on the meta device (`Spec`, `count`): rank 0's
slice at a tp degree run once forward, through the training loss and backward on one sample,
its kernels, tp exchanges, saved activations (under each recomputation too), its step's peak of
live bytes, and parameters; and a deep model of alike blocks counted at 2 and 3 blocks and
extrapolated (`repeated`), so a 96-block model costs what a 3-block one does. The formulas that
use the counts are `gradmesh.simulate.mesh`'s.

**Attention as a GPU runs it.** On the meta device `F.scaled_dot_product_attention` would take
its unfused path (the scores made, softmaxed and kept for backward: S x S a head), which no GPU
trains with: `fused_attention` sends every call to the FlashAttention kernel's own operation
(which keeps queries, keys, values, output and log-sum-exp, and recomputes the scores in its
backward, as it does on the GPU), the causal mask gradmesh's Hugging Face wrapper passes on the
meta device taken as the causal flag it stands for (`models.hf.causal_mask`), any other mask
as the memory-efficient kernel's bias. A model that
computes its scores itself (a softmax over S x S) is priced as it runs, its scores kept
(`Counted.attention` "unfused"); one whose blocks have an attention module that does neither
cannot be classified, and says so in one line.

**The step's peak** (`live_peak`): the most bytes live at once during a forward, the loss and
backward (gradients allocated before, as after the first step), beyond what was live before:
each result an operation makes counted from its making until its tensor is freed (a
`TorchDispatchMode` and a finalizer per tensor; views make nothing). On the CPU it is within
15 % of the allocator's own figure (`peak_bytes`, which rounds every block up; a test holds
them together), and on the meta device it is the only figure there is. The loss is the
trainer's (`cross_entropy` over the logits, upcast to fp32 in mixed precision, as autocast
does), whose fp32 logits and their gradient are the peak of a large-vocabulary model."""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gradmesh.errors import GradmeshError


@dataclass(frozen=True)
class Spec:
    """A model to build on the meta device, and what it trains with."""

    model: str
    args: dict[str, Any]
    sequence: int
    vocab: int
    precision: str
    optimizer: str = "adamw"
    sequence_parallel: bool = False
    """With tp: the norms and residuals on each rank's part of the sequence (`--sequence-
    parallel`)."""
    loss_parallel: bool = False
    """With tp: the head's logits left split by vocabulary and the loss computed on the parts
    (`vocab_parallel_cross_entropy`), not gathered."""
    fused_attention: bool = True
    """`F.scaled_dot_product_attention` priced as a GPU's fused kernel (module docstring);
    False: as its unfused path, the scores made and kept (GPUs before FlashAttention, 2021's
    Megatron-LM runs)."""

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
    attention: str = "fused"
    """How the model's attention runs (module docstring): fused, unfused (scores kept) or
    none (a model without attention)."""
    calls: dict[str, float] = dataclasses.field(default_factory=dict)
    """Operations of a forward and backward by kind: the kernels a GPU launches."""


def count(spec: Spec, tp: int) -> Counted:
    """The module docstring's counts of rank 0's slice at tp."""
    from gradmesh.layout.config import LayoutConfig
    from gradmesh.layout.memory import saved_activations
    from gradmesh.layout.tensor.layers import dry_exchanges
    from gradmesh.models.blocks import block_list
    from gradmesh.models.flops import KernelCounter
    from gradmesh.train.recipe import rank_slice

    net, ids = spec.build()
    sp = spec.sequence_parallel and tp > 1
    layout = LayoutConfig(tensor_parallel=tp, sequence_parallel=sp)
    split = spec.loss_parallel and tp > 1
    if split:
        net.__class__ = _vocab_split(type(net))
    net = rank_slice(net, layout, spec.model)  # the recipe's slice
    counter, scores = KernelCounter(), _Scores()

    def loss() -> torch.Tensor:
        return training_loss(net(ids), ids, spec.mixed, split)

    fused = fused_attention if spec.fused_attention else _unfused
    with fused() as sdpa, dry_exchanges(tp) as dry:
        with counter, scores:  # one forward and backward: its kernels and what it saves
            saved = saved_activations(net, loss, ids, peak=False)
        made, attention_calls = [(n, kind) for _, n, kind in dry.made], sdpa[0]
        saved.peak = live_peak(lambda: loss().backward())  # type: ignore[no-untyped-call]
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
    kind = _attention_kind(spec, net, names, attention_calls, scores.seen)
    calls = {k: float(n) for k, n in counter.calls.items()}
    return Counted(kernels, made, saved, per_block, rest, params, counter.useful, kind, calls)


def _vocab_split(cls: type) -> type:
    """`cls` whose plans keep the head's logits split (colwise, not gathered)."""

    def split(plan: dict[str, str]) -> dict[str, str]:
        gathered = ("colwise_gather_output", "colwise(gather)")
        return {k: "colwise" if v in gathered else v for k, v in plan.items()}

    def plan_of(name: str) -> property:
        return property(lambda self: split(getattr(super(made, self), name)))

    attrs = {name: plan_of(name) for name in ("tp_plan", "sp_plan") if hasattr(cls, name)}
    made: type = type(cls.__name__, (cls,), attrs)
    return made


def training_loss(
    out: Any, ids: torch.Tensor, mixed: bool, vocab_split: bool = False
) -> torch.Tensor:
    """The trainer's loss on a count's forward (`layout.loss.cross_entropy`, the ids as their
    own targets; `vocab_parallel_cross_entropy` on logits split by vocabulary), its logits
    upcast to fp32 in mixed precision (autocast runs cross-entropy in fp32), plus any scalar
    loss the model returns (a mixture's balance loss)."""
    from gradmesh.layout.loss import logits_of
    from gradmesh.layout.tensor.vocab import vocab_parallel_cross_entropy

    logits = logits_of(out)
    if logits.dim() != 3 or logits.shape[:2] != ids.shape:
        from gradmesh.models.flops import scalar_of

        return scalar_of(out)  # not token logits: a sum to start backward from
    logits = logits.float() if mixed else logits
    flat, targets = logits.reshape(-1, logits.shape[-1]), ids.reshape(-1)
    if vocab_split:
        loss = vocab_parallel_cross_entropy(flat, targets).mean()
    else:
        loss = F.cross_entropy(flat, targets)
    extra = [t for t in tree_flatten(out)[0] if torch.is_tensor(t) and t.dim() == 0]
    return loss + sum(t.float() for t in extra) if extra else loss


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention


@contextlib.contextmanager
def fused_attention() -> Iterator[list[int]]:
    """Within: `F.scaled_dot_product_attention` on meta tensors runs as the FlashAttention
    operation (module docstring); yields a one-element list counting the calls."""
    from gradmesh.layout.context.parallel import TORCH_ATTENTION, attention_replaced
    from gradmesh.models.hf import is_causal_mask

    calls = [0]

    def fused(
        q: Any,
        k: Any,
        v: Any,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: Any = None,
        enable_gqa: bool = False,
    ) -> Any:
        if not q.is_meta:
            return TORCH_ATTENTION(
                q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa=enable_gqa
            )
        calls[0] += 1
        if k.shape[-3] != q.shape[-3]:  # grouped queries: the shared heads repeated, as
            rep = q.shape[-3] // k.shape[-3]  # a model that repeats them itself does
            k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
        if attn_mask is not None and not is_causal_mask(attn_mask):  # a mask of its own: the
            bias = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)  # efficient
            return _EFFICIENT(q, k, v, bias, True, dropout_p, False, scale=scale)[0]  # kernel
        return _FLASH(q, k, v, dropout_p, is_causal or attn_mask is not None, scale=scale)[0]

    with attention_replaced(fused):
        yield calls


@contextlib.contextmanager
def _unfused() -> Iterator[list[int]]:
    yield [0]


_SOFTMAXES = (torch.ops.aten._softmax, torch.ops.aten.softmax, torch.ops.aten._safe_softmax)


class _Scores(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts softmaxes over square trailing dimensions: scores a model computes itself."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in _SOFTMAXES:
            self.seen += out.dim() >= 2 and out.shape[-1] == out.shape[-2] > 1
        return out


def _attention_kind(spec: Spec, net: Any, names: list[str], fused: int, scores: int) -> str:
    from gradmesh.layout.memory import attention_name

    if fused:
        return "fused"
    if scores:
        return "unfused"
    if any(attention_name(net, n) for n in names):
        raise GradmeshError(
            f"model {spec.model}: its blocks have attention modules, but their forward neither "
            "calls F.scaled_dot_product_attention (priced as a GPU's fused attention) nor makes "
            "a softmax over square scores (priced as unfused): the memory model cannot classify "
            "it"
        )
    return "none"


def live_peak(step: Callable[[], Any]) -> int:
    """The module docstring's step peak: the most bytes `step()`'s results hold at once."""
    live = _Live()
    with live:
        step()
    return live.peak


class _Live(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.now = self.peak = 0

    def _free(self, n: int) -> None:
        self.now -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view, or written in place: nothing made
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                n = t.numel() * t.element_size()
                self.now += n
                self.peak = max(self.peak, self.now)
                weakref.finalize(t, self._free, n)
        return out


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
    per_block = ("blocks", "inputs", "kept", "ops", "attention", "block_flops", "ops_redone")
    tables = {k: grown(getattr(three.saved, k), names) for k in (*per_block, "attention_redone")}
    more_saved = sum(tables["blocks"].values()) - sum(three.saved.blocks.values())
    saved = dataclasses.replace(three.saved, **tables, peak=three.saved.peak + more_saved)
    return Counted(
        kernels,
        exchanges,
        saved,
        grown(three.block_param_bytes, names),
        three.rest_param_bytes,
        grow(two.parameters, three.parameters),
        grow(two.flops, three.flops),
        three.attention,
        {k: grow(two.calls.get(k, 0.0), n) for k, n in three.calls.items()},
    )
