"""A tensor-parallel plan: module names (with wildcards) mapped to how each module is split over
the mesh's `tp` axis. This is how any model, not only a sequence of layers, is made
tensor-parallel: `{"blocks.*.attn.qkv": "colwise(1,1,1)", "blocks.*.attn.proj": "rowwise"}`.

Styles (a string each, so that a model can declare its plan as data, as Hugging Face models
declare `base_model_tp_plan`):

- `colwise`: a Linear's output features (a Conv2d's output channels) split; output local.
  `colwise(gather)` all-gathers the output (`colwise_rep`, Hugging Face's name, is the same).
  `colwise(1,1,1)` splits a fused projection chunk by chunk in those proportions (q, k, v in one
  matrix; `colwise(8,2,2)` for 8 query and 2 key/value heads), so each rank holds whole heads.
- `rowwise`: input features split (the output of a colwise layer), output allreduced.
- `embedding`: an `nn.Embedding` split by vocabulary rows (`VocabParallelEmbedding`).
- Sequence parallelism (`gradmesh.layout.tensor.sequence`): `rowwise(seq)` reduce-scatters
  the partial sums along the sequence instead of allreducing them; `sequence` runs a module (a
  norm, dropout) on this rank's part of the sequence, its parameters' gradients summed over tp;
  `sequence(gather)` does so and all-gathers its output for the colwise layers after it;
  `sequence(scatter)` cuts a module's input to this rank's part (the first block).
- `heads(attr, ...)`: no weight is split; the module's integer attributes (its head counts, its
  width) are divided by tp, so that an attention module that reshapes by `self.n_head` works on
  its local heads. Refused with one line when an attribute is not divisible (grouped-query
  attention whose key/value heads do not divide tp).

A `*` in a name matches one path segment (`blocks.*.mlp.fc1` matches `blocks.0.mlp.fc1`).
Parameters tied between modules (an output head sharing the embedding's weight) stay one
parameter: its slice is made once and used by both modules, which must split it alike.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from dataclasses import dataclass

from torch import nn

from gradmesh.errors import GradmeshError
from gradmesh.layout.tensor.layers import ParallelLayer, chunk_sizes, parallel_layer, shard
from gradmesh.layout.tensor.sequence import (
    mark_sequence,
    reduce_scatter_sequence,
    sum_gradient_over_tp,
)
from gradmesh.layout.tensor.vocab import VocabParallelEmbedding

KINDS = ("colwise", "rowwise", "embedding", "heads", "sequence")
SEQUENCE_MODES = ("", "gather", "scatter")
ALIASES = {  # Hugging Face's names for the same styles
    "colwise_rep": "colwise(gather)",
    "colwise_gather_output": "colwise(gather)",
    "embedding_rowwise": "embedding",
    "local_colwise": "colwise",
    "local_rowwise": "rowwise",
}
_STYLE = re.compile(r"^\s*([a-z_]+)\s*(?:\(([^)]*)\))?\s*$")


@dataclass(frozen=True)
class Style:
    kind: str
    chunks: tuple[int, ...] = ()
    gather: bool = False
    attrs: tuple[str, ...] = ()
    mode: str = ""
    """`rowwise(seq)`: "seq"; `sequence(...)`: its mode, one of `SEQUENCE_MODES`."""

    @property
    def dim(self) -> int:
        """The weight dimension this style splits."""
        return 1 if self.kind == "rowwise" else 0


def parse_style(text: str, where: str) -> Style:
    """`text` as a `Style`, or one line naming `where` it came from."""
    text = ALIASES.get(text.strip(), text)
    match = _STYLE.match(text)
    kind = match.group(1) if match else ""
    if kind not in KINDS:
        raise GradmeshError(
            f"{where}: unknown style {text!r} (valid: colwise, colwise(gather), colwise(1,1,1), "
            "rowwise, rowwise(seq), embedding, heads(attr,...), sequence, sequence(gather), "
            "sequence(scatter))"
        )
    assert match is not None
    args = [a.strip() for a in (match.group(2) or "").split(",") if a.strip()]
    if kind == "heads":
        if not args or not all(a.isidentifier() for a in args):
            raise GradmeshError(
                f"{where}: heads(...) names the attributes to divide, like heads(n_head)"
            )
        return Style(kind, attrs=tuple(args))
    if kind == "sequence" and len(args) <= 1 and (args or [""])[0] in SEQUENCE_MODES:
        return Style(kind, mode=(args or [""])[0])
    if kind == "rowwise" and args == ["seq"]:
        return Style(kind, mode="seq")
    if kind == "colwise" and args == ["gather"]:
        return Style(kind, gather=True)
    if kind == "colwise" and args and all(a.isdigit() and int(a) > 0 for a in args):
        return Style(kind, chunks=tuple(int(a) for a in args))
    if args:
        raise GradmeshError(f"{where}: style {text!r} takes no such arguments")
    return Style(kind)


def matches(pattern: str, name: str) -> bool:
    """Whether module `name` fits `pattern` (a `*` stands for one segment of the name)."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(
        fnmatch.fnmatchcase(n, p) for p, n in zip(parts, names, strict=True)
    )


def resolve(model: nn.Module, plan: dict[str, str], model_name: str) -> dict[str, Style]:
    """Each module `plan` names (wildcards expanded, in the model's order) with its style; one
    line for a pattern that matches no module, listing the nearest names."""
    names = [n for n, _ in model.named_modules() if n]
    out: dict[str, Style] = {}
    for pattern, text in plan.items():
        style = parse_style(text, f"model {model_name}: plan entry {pattern!r}")
        hits = [n for n in names if matches(pattern, n)]
        if not hits:  # the nearest names, numbered segments written as wildcards
            forms = list(dict.fromkeys(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n) for n in names))
            near = difflib.get_close_matches(pattern, forms, n=4, cutoff=0.4)
            raise GradmeshError(
                f"model {model_name}: its plan names no module {pattern!r}"
                + (f" (nearest: {', '.join(near)})" if near else "")
            )
        for name in hits:
            out[name] = style
    return {n: out[n] for n in names if n in out}


def _fits(size: int, tp: int) -> str:
    return ", ".join(str(d) for d in range(1, min(size, 64) + 1) if size % d == 0)


def _check_one(model: nn.Module, name: str, style: Style, tp: int, model_name: str) -> None:
    module = model.get_submodule(name)
    where = f"layer {name} of model {model_name}"
    if style.kind == "sequence":  # any module: it runs on a part of the sequence as it is
        return
    if style.kind == "heads":
        for attr in style.attrs:
            value = getattr(module, attr, None)
            if not isinstance(value, int):
                raise GradmeshError(f"{where} has no integer attribute {attr!r} to divide by tp")
            if value % tp:
                raise GradmeshError(
                    f"--tensor-parallel {tp} does not divide {attr}={value} of {where} (each "
                    f"rank holds whole heads); tensor-parallel sizes that fit: {_fits(value, tp)}"
                )
        return
    if style.kind == "embedding":
        if type(module) is not nn.Embedding or module.sparse or module.max_norm is not None:
            raise GradmeshError(  # a subclass's forward (a scale: Gemma's) would be lost
                f"{where} is a {type(module).__name__}; the embedding style splits a dense "
                "nn.Embedding (not a subclass, no sparse gradients, no max_norm)"
            )
        size, what = module.num_embeddings, "vocabulary rows"
    elif isinstance(module, ParallelLayer):
        raise GradmeshError(f"{where} is split already (a plan applies once, to the whole model)")
    else:
        if not isinstance(module, nn.Linear | nn.Conv2d) or (
            isinstance(module, nn.Conv2d) and module.groups != 1
        ):
            raise GradmeshError(
                f"{where} is a {type(module).__name__}; {style.kind} splits Linear and "
                "(ungrouped) Conv2d layers"
            )
        _check_keepable(module, where)
        size = int(module.weight.shape[style.dim])
        what = "output " if style.kind == "colwise" else "input "
        what += "channels" if isinstance(module, nn.Conv2d) else "features"
    if style.chunks:
        try:
            rows = chunk_sizes(size, style.chunks)
        except ValueError as exc:
            raise GradmeshError(f"{where}: {exc}") from None
        bad = [r for r in rows if r % tp]
        if bad:
            raise GradmeshError(
                f"--tensor-parallel {tp} does not divide a chunk of {bad[0]} {what} of {where} "
                f"(chunks {style.chunks})"
            )
    elif size % tp:
        raise GradmeshError(
            f"--tensor-parallel {tp} does not divide the {size} {what} of {where} "
            f"({style.kind}); tensor-parallel sizes that fit: {_fits(size, tp)}"
        )


def _check_keepable(module: nn.Module, where: str) -> None:
    """One line unless a split layer keeps what `module` is: a split Linear or Conv2d is a
    plain one of this rank's widths, so a subclass's own attributes and forward, and a
    convolution padded other than with zeros, would be lost."""
    kind = nn.Linear if isinstance(module, nn.Linear) else nn.Conv2d
    if type(module) is not kind and type(module).__module__.split(".")[0] != "gradmesh":
        raise GradmeshError(
            f"{where} is a {type(module).__name__}, a subclass of nn.{kind.__name__} whose own "
            f"attributes and forward a split layer would not keep: split the nn.{kind.__name__} "
            "inside it, or leave it out of the plan"
        )
    mode = getattr(module, "padding_mode", "zeros")
    if mode != "zeros":
        raise GradmeshError(
            f"{where} pads with padding_mode={mode!r}, which a split Conv2d does not keep: use "
            "padding_mode='zeros' or leave it out of the plan"
        )


def check_plan(
    model: nn.Module, plan: dict[str, str], tp: int, model_name: str
) -> dict[str, Style]:
    """One line, before anything runs, unless every module of `plan` exists, takes its style,
    and has split sizes that `tp` divides; returns the resolved plan."""
    styles = resolve(model, plan, model_name)
    for name, style in styles.items():
        _check_one(model, name, style, tp, model_name)
    _check_tied(model, styles, model_name)
    _check_sequence(styles, model_name)
    return styles


def _check_sequence(styles: dict[str, Style], model_name: str) -> None:
    """A module that runs on a part of the sequence (`sequence`, `sequence(gather)`) sums its
    parameters' gradients over tp, so it may hold no split layer (whose slices differ)."""
    for name, style in styles.items():
        if style.kind != "sequence" or style.mode == "scatter":
            continue
        inside = [n for n, s in styles.items() if n.startswith(name + ".") and s.kind != "heads"]
        if inside:
            raise GradmeshError(
                f"model {model_name}: {name} is {style.kind}({style.mode}) but holds the split "
                f"layer {inside[0]}; mark the norms and dropout inside it, not the block"
            )


def _check_tied(model: nn.Module, styles: dict[str, Style], model_name: str) -> None:
    """A parameter shared by several modules must be split alike by each (or by none)."""
    seen: dict[int, tuple[str, tuple[int, tuple[int, ...]] | None]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter):
            continue
        style = styles.get(name)
        cut = None
        if style is not None and style.kind not in ("heads", "sequence"):
            cut = (style.dim, style.chunks)
        first = seen.setdefault(id(weight), (name, cut))
        if first[1] != cut:
            raise GradmeshError(
                f"model {model_name}: modules {first[0]} and {name} share one weight but the "
                "plan splits it differently on each (a tied weight needs the same rows on both)"
            )


def apply_tp_plan(
    model: nn.Module, plan: dict[str, str], parts: int, index: int, model_name: str = "model"
) -> nn.Module:
    """Replace each module of `plan` by this rank's slice (`index` of `parts`), in place;
    returns `model`. With `parts` 1 the model is left as it is."""
    styles = check_plan(model, plan, parts, model_name)
    if parts == 1:
        return model
    made: dict[tuple[int, int, tuple[int, ...]], nn.Parameter] = {}

    def slicer(t: nn.Parameter | object, dim: int, chunks: tuple[int, ...]) -> nn.Parameter:
        assert isinstance(t, nn.Parameter)
        key = (id(t), dim, chunks)
        if key not in made:  # a tied parameter is sliced once and shared
            made[key] = nn.Parameter(shard(t, dim, parts, index, chunks))
        return made[key]

    summed: set[int] = set()  # parameters whose gradient is summed over tp (sequence parallel)
    for name, style in styles.items():
        module = model.get_submodule(name)
        if style.kind == "sequence":
            mark_sequence(module, style.mode, summed)
            continue
        if style.kind == "heads":
            for attr in style.attrs:
                setattr(module, attr, getattr(module, attr) // parts)
            continue
        if style.kind == "embedding":
            assert isinstance(module, nn.Embedding)
            new: nn.Module = VocabParallelEmbedding(
                module, parts, index, slicer(module.weight, 0, ())
            )
        else:
            assert isinstance(module, nn.Linear | nn.Conv2d)
            new = parallel_layer(
                module,
                style.kind,
                parts,
                index,
                chunks=style.chunks,
                gather=style.gather,
                slicer=slicer,
                reduce=reduce_scatter_sequence if style.mode == "seq" else None,
            )
            if style.mode == "seq" and new.bias is not None:  # added to a part of the tokens
                sum_gradient_over_tp(new.bias, summed)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
    return model


def shard_specs(model: nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each split parameter of a tensor-parallel `model` (by its name in `named_parameters`)
    with the dimension and chunks it is split by: what `unshard` needs to put the whole
    parameter back together from every tp rank's slice. Parameters not listed are whole."""
    specs: dict[int, tuple[int, tuple[int, ...]]] = {}
    for module in model.modules():
        if isinstance(module, VocabParallelEmbedding):
            specs[id(module.weight)] = (0, ())
        elif isinstance(module, ParallelLayer):
            dim = 0 if module.style == "colwise" else 1
            specs[id(module.weight)] = (dim, module.chunks)
            if module.bias is not None and module.style == "colwise":
                specs[id(module.bias)] = (0, module.chunks)
    everyone = model.named_parameters(remove_duplicate=False)  # a tied weight under each name
    return {n: specs[id(p)] for n, p in everyone if id(p) in specs}
