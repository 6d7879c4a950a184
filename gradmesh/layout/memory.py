"""Activation checkpointing: a block keeps, from its forward to its backward, only its inputs,
and its backward runs its forward again to rebuild the rest (`torch.utils.checkpoint`,
non-reentrant, so it composes with autograd hooks, tensor-parallel operators and gradient
accumulation). The blocks are the model's (`gradmesh.models.blocks`): every one (`blocks`), every
k-th (`every:k`), each block keeping the outputs of the operations costliest to redo (`ops`:
`gradmesh.layout.selective`, torchtitan's per-operation policy), or only each block's attention
module (`attention`: Megatron's selective recomputation, which keeps the projections' and
the MLP's activations and rebuilds what attention saves, its queries, keys, values and scores,
cheap to recompute for their size). The
memory it saves is the activations inside what is recomputed, for one more forward of it in
backward (about a third more arithmetic for a block whose backward costs twice its forward).

A block's class is swapped for a subclass whose forward checkpoints the original's: parameter
names, tensor-parallel plans, checkpoints and deep copies (the graph pipeline traces a copy) see
the same module, where a wrapper module would rename every parameter and a forward patched on
the instance would keep calling the original object from a copy.

What a step holds is measured here too, for the benchmarks and the mesh planner's memory model
(`gradmesh.planner.mesh_memory`): `peak_bytes`, the most live tensor bytes a step adds
(torch's profiler with `profile_memory=True`: every allocation and free the CPU allocator
reports, summed in time order), and
`saved_activations`, what each block saves for its backward (autograd's saved-tensor hooks,
each storage counted once, the parameters and buffers not at all) and what enters it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import gradmesh.layout.selective as selective
from gradmesh.errors import GradmeshError
from gradmesh.layout.config import every_of
from gradmesh.models.blocks import block_list

_CLASSES: dict[tuple[type[nn.Module], bool], type[nn.Module]] = {}


def _recomputed(cls: type[nn.Module], ops: bool = False) -> type[nn.Module]:
    """`cls` whose forward keeps only its inputs for backward (with `ops`, also the outputs the
    per-operation policy keeps: `gradmesh.layout.selective`), made once per class."""
    if (cls, ops) not in _CLASSES:
        more: dict[str, Any] = {"context_fn": selective.contexts} if ops else {}

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            run = super(made, self).forward  # type: ignore[arg-type]
            if not torch.is_grad_enabled():
                return run(*args, **kwargs)
            return checkpoint(run, *args, use_reentrant=False, **more, **kwargs)

        made = type(cls.__name__, (cls,), {"forward": forward, "recomputed": True})
        made.__qualname__ = cls.__qualname__
        _CLASSES[cls, ops] = made
    return _CLASSES[cls, ops]


def checkpoint_blocks(model: nn.Module, spec: str, model_name: str) -> list[str]:
    """Make every `every_of(spec)`-th block of `model` (with `attention`, each block's attention
    module) recompute its activations in backward, in place; returns their names (one line
    when the model has no blocks, or a block no attention)."""
    every = every_of(spec)
    names = block_list(model)
    if not names:
        raise GradmeshError(
            f"--activation-checkpointing: model {model_name} has no list of blocks to recompute "
            "(a ModuleList or Sequential of repeated modules)"
        )
    chosen = names[::every]
    if spec == "attention":
        chosen = [attention_of(model, name, model_name) for name in chosen]
    for name in chosen:
        block = model.get_submodule(name)
        if not getattr(block, "recomputed", False):
            block.__class__ = _recomputed(type(block), spec == "ops")
    return chosen


ATTENTION_NAMES = ("attn", "attention", "self_attn")


def attention_name(model: nn.Module, block: str) -> str | None:
    """`attention_of`'s name, None where the block has no attention module."""
    for name, module in model.get_submodule(block).named_modules():
        last = name.rpartition(".")[2]
        if name and (last in ATTENTION_NAMES or type(module).__name__.endswith("Attention")):
            return f"{block}.{name}"
    return None


def attention_of(model: nn.Module, block: str, model_name: str) -> str:
    """The name of `block`'s attention module: its first descendant named as one usually is
    (`ATTENTION_NAMES`: gradmesh's GPT, Hugging Face's Llama, GPT-2 and BERT-like models) or
    whose class name ends in Attention; one line when it has none."""
    found = attention_name(model, block)
    if found is not None:
        return found
    raise GradmeshError(
        f"--activation-checkpointing attention: block {block} of model {model_name} has no "
        f"attention module (a submodule named {', '.join(ATTENTION_NAMES)} or a class ending in "
        "Attention); use blocks or every:K"
    )


@contextlib.contextmanager
def _native_stderr_muted() -> Iterator[None]:
    """The process's stderr (file descriptor 2) sent to /dev/null: torch's profiler (Kineto)
    writes a line there as it starts and as it stops, with no setting that turns them off, and
    a command's output (one line on bad input) must not carry them."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def peak_bytes(step: Any) -> int:
    """The most tensor bytes `step()` holds at once beyond what was live before it: the
    allocator's own events, in time order. Not the ops' attributed memory (what torch's
    profiler tables show), which misses every free made outside an op: the buffers FSDP2 drops
    in Python, the tensors a recomputing block lets go, so that summing it overstated a sharded
    step's peak by up to a copy of the parameters. A block allocated before `step()` and freed
    inside it is not seen to go (the allocator does not know its size), which can only
    overstate. The events are read from the profiler's kineto results, an attribute of the
    torch this project pins."""
    from torch.profiler import ProfilerActivity, profile

    prof: Any = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _native_stderr_muted():
        prof.start()
    try:
        step()
    finally:
        with _native_stderr_muted():
            prof.stop()
    live = top = 0
    memory = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(memory, key=lambda e: e.start_ns()):
        live += event.nbytes()
        top = max(top, live)
    return top


@dataclass
class Saved:
    """One forward and backward, as `saved_activations` measured it (bytes)."""

    blocks: dict[str, int]
    """What each block saved for its backward."""
    inputs: dict[str, int]
    """What entered each block (its tensor arguments): what checkpointing keeps instead."""
    rest: int
    """What the rest of the model and the loss saved (embeddings, head, loss)."""
    peak: int
    """The step's peak of live tensor bytes beyond what was live before it (`peak_bytes`)."""
    kept: dict[str, int] = field(default_factory=dict)
    """What a zero-bubble schedule keeps from each block's B to its W: the gradients of the
    outputs of its modules that hold weights (`gradmesh.layout.pipeline.split` keeps what each
    such operation receives), counted as those outputs' bytes."""
    kept_rest: int = 0
    """The same outside the blocks (the embeddings', the head's: its logits)."""
    ops: dict[str, int] = field(default_factory=dict)
    """What each block keeps under the per-operation policy (`--activation-checkpointing ops`):
    its input and the outputs `gradmesh.layout.selective` keeps."""
    attention: dict[str, int] = field(default_factory=dict)
    """What each block keeps with only its attention module recomputed (`attention`)."""
    block_flops: dict[str, float] = field(default_factory=dict)
    """Each block's forward FLOPs."""
    ops_redone: dict[str, float] = field(default_factory=dict)
    """The forward FLOPs of each block the per-operation policy runs again in backward."""
    attention_redone: dict[str, float] = field(default_factory=dict)
    """Those of each block's attention module."""

    def recomputed(self, mode: str) -> tuple[dict[str, int], dict[str, float]]:
        """(what each block keeps, the forward FLOPs it runs again) under recomputation `mode`:
        "" none, "blocks" every block, "ops" or "attention" selectively."""
        if mode == "ops":
            return self.ops, self.ops_redone
        if mode == "attention":
            return self.attention, self.attention_redone
        if mode == "blocks":
            return self.inputs, self.block_flops
        return self.blocks, dict.fromkeys(self.blocks, 0.0)


def _storage(t: torch.Tensor) -> tuple[object, int]:
    """(an identity of `t`'s storage, its bytes). A meta tensor has no storage to point at
    (every one's address is 0): it stands for itself and its own bytes, so views of one result
    saved apart sum to at most its size and a tensor saved twice counts once."""
    if t.is_meta:
        base = t._base if t._base is not None else t
        return (id(base), t.storage_offset(), t.numel()), t.numel() * t.element_size()
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def saved_activations(
    model: nn.Module, run: Callable[[], torch.Tensor], inputs: Any = (), peak: bool = True
) -> Saved:
    """What `run()` (a forward of `model` and its loss on `inputs`) saves for backward, per
    block of the model's block list and outside them, and (with `peak`) the peak of it and its
    backward together (gradients allocated first, as in a training step after the first). The
    inputs, parameters and buffers were allocated before the step and outlive it: not counted
    (an input is often a view of the whole dataset's storage). Per block too: what it keeps
    under selective recomputation, per operation (`gradmesh.layout.selective`'s policy) and of
    its attention module only, and the forward FLOPs each recomputes. Works on the meta device
    (the simulator's models), without the peak: the profiler sees no meta allocation."""
    from torch.utils._pytree import tree_leaves

    names = block_list(model)
    held = [*model.parameters(), *model.buffers(), *tree_leaves(inputs)]
    before = {_storage(t)[0] for t in held if torch.is_tensor(t)}
    seen: set[object] = set()
    kept: list[torch.Tensor] = []  # alive until counted: a meta tensor's identity is its id
    saved, outputs, inner = _ByBlock(names), _ByBlock(names), _ByBlock(names)
    entered, owner = dict.fromkeys(names, 0), ["", ""]  # the block, its attention if running
    policy = selective.PolicyCount(lambda: owner[0], lambda: bool(owner[1]))

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, n = _storage(t)
        kept.append(t)
        if n and ptr not in before and ptr not in seen:
            seen.add(ptr)
            saved.add(owner[0], n)
            if owner[1]:
                inner.add(owner[0], n)
        return t

    def enter(name: str) -> Callable[..., None]:
        def hook(_m: Any, args: tuple[Any, ...]) -> None:
            owner[0] = name
            policy.entered(name)
            entered[name] = _arg_bytes(args)

        return hook

    def leave(*_: Any) -> None:
        owner[0] = ""

    def weighted(_m: Any, _args: Any, out: Any) -> None:  # what a zero-bubble W keeps
        leaves = [t for t in tree_leaves(out) if torch.is_tensor(t)]
        outputs.add(owner[0], sum(t.numel() * t.element_size() for t in leaves))

    hooks = _watch(model, [(n, enter(n)) for n in names], leave, weighted)
    hooks += _watch_attention(model, names, owner, inner)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), policy:
            loss = run()
    finally:
        for h in hooks:
            h.remove()
    measured = _peak_after(model, loss, run, peak)
    out = Saved(saved.blocks, entered, saved.rest, measured, outputs.blocks, outputs.rest)
    return _selective(out, policy, inner)


def _peak_after(
    model: nn.Module, loss: torch.Tensor, run: Callable[[], torch.Tensor], peak: bool
) -> int:
    """`loss`'s backward (the gradients allocated, as after the first step: the meta count's
    `live_peak` relies on it too), then with `peak` the peak of a step of `run` (nothing else
    run: the meta count counts the kernels of that forward and backward)."""
    loss.backward()  # type: ignore[no-untyped-call]
    if not peak:
        return 0
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()

    def step() -> None:
        run().backward()  # type: ignore[no-untyped-call]

    return peak_bytes(step)


def _selective(out: Saved, policy: selective.PolicyCount, inner: _ByBlock) -> Saved:
    """`out` with what each block keeps and redoes under the selective recomputations."""
    names, entered = list(out.blocks), out.inputs
    out.ops = {n: entered[n] + policy.kept.get(n, 0) for n in names}
    out.ops_redone = {n: policy.redone.get(n, 0.0) for n in names}
    out.block_flops = {n: policy.flops.get(n, 0.0) for n in names}
    out.attention = {n: out.blocks[n] - inner.blocks[n] + inner.entered.get(n, 0) for n in names}
    out.attention_redone = {n: policy.inner.get(n, 0.0) for n in names}
    return out


def _arg_bytes(args: tuple[Any, ...]) -> int:
    return sum(a.numel() * a.element_size() for a in args if torch.is_tensor(a))


def _watch_attention(
    model: nn.Module, names: list[str], owner: list[str], inner: _ByBlock
) -> list[Any]:
    """Hooks on each block's attention module (where it has one): `owner[1]` names its block
    while it runs, and `inner.entered` gets what enters it."""
    hooks: list[Any] = []
    inner.entered = {}
    for block in names:
        found = attention_name(model, block)
        if found is None:
            continue

        def start(_m: Any, args: tuple[Any, ...], b: str = block) -> None:
            owner[1] = b
            inner.entered[b] = _arg_bytes(args)

        def stop(*_: Any) -> None:
            owner[1] = ""

        module = model.get_submodule(found)
        hooks += [module.register_forward_pre_hook(start), module.register_forward_hook(stop)]
    return hooks


def _watch(
    model: nn.Module,
    entries: list[tuple[str, Callable[..., None]]],
    leave: Callable[..., None],
    weighted: Callable[..., None],
) -> list[Any]:
    """Hooks: each named block's entry and exit, and every module holding weights' output."""
    hooks = []
    for name, enter in entries:
        block = model.get_submodule(name)
        hooks += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    for module in model.modules():
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            hooks.append(module.register_forward_hook(weighted))
    return hooks


class _ByBlock:
    """Bytes counted against the block running now (by name), or outside the blocks; and
    (`entered`) what entered a module of each block."""

    def __init__(self, names: list[str]) -> None:
        self.blocks, self.rest = dict.fromkeys(names, 0), 0
        self.entered: dict[str, int] = {}

    def add(self, owner: str, n: int) -> None:
        if owner:
            self.blocks[owner] += n
        else:
            self.rest += n
