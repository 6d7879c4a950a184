"""`gradmesh export CHECKPOINT_DIR --to OUTDIR`: a checkpoint of any layout as one model
directory another tool opens.

The newest complete checkpoint's parts are put back together (`whole_model`: tp slices, FSDP
shards, pipeline stages), the run's model is built again from the checkpoint's identity (its
model, arguments, dataset and sequence length: the trainer's own builder, on the meta device
for a pretrained one) and given the whole state. Then:
- `--format hf` (the default for `hf:` models): Hugging Face's `save_pretrained` writes the
  config and safetensors (sharded above `--max-shard-size`, with its index), which
  `AutoModelForCausalLM.from_pretrained(OUTDIR)` loads.
- `--format safetensors` (the default for every other model, gradmesh's GPT among them):
  `model.safetensors` holds the model's state dict under gradmesh's own names, a tensor tied to
  another stored once (its metadata `tied` lists `name=stored name`), and `config.json` holds
  `{"gradmesh_model": name, "model_args": ..., "vocab": ..., "sequence_length": ...}`, what
  `gradmesh.models.registry.build_model` takes to make the model again (docs/your_model.md).

The whole export is written to a temporary folder beside OUTDIR and renamed into place at the
end: a failed export leaves nothing, and an OUTDIR that exists and is not empty is refused, so
nothing is ever overwritten.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

from gradmesh.errors import GradmeshError, first_line
from gradmesh.train.checkpoint.files import complete, read_meta
from gradmesh.train.checkpoint.reshard import whole_model
from gradmesh.train.config import ExportConfig
from gradmesh.train.pretrained import retie, tied_names


def run(config: ExportConfig, _command: list[str]) -> int:
    written = export(config.checkpoint, config.to, config.format, config.max_shard_size)
    print(f"gradmesh export: {written}")
    return 0


def export(directory: str, out: str, fmt: str = "auto", max_shard_size: str = "5GB") -> str:
    """Write the newest complete checkpoint of `directory` to `out` (the module docstring);
    returns a line saying what was written."""
    if not directory or not out:
        raise GradmeshError("export needs a checkpoint folder and --to OUTDIR")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise GradmeshError(f"{out} exists and is not an empty folder: nothing is overwritten")
    found = complete(directory)
    if not found:
        raise GradmeshError(f"no complete checkpoint in {directory}")
    meta = read_meta(found[0])
    name = str(meta.identity.get("model", ""))
    hf = name.startswith("hf:")
    fmt = ("hf" if hf else "safetensors") if fmt == "auto" else fmt
    if fmt == "hf" and not hf:
        raise GradmeshError(
            f"checkpoint {meta.checkpoint} holds model {name}, not a Hugging Face one: "
            "export it with --format safetensors"
        )
    if fmt != "hf" and max_shard_size != ExportConfig.max_shard_size:
        raise GradmeshError(
            f"--max-shard-size: not read by --format {fmt}, which writes one file (hf's shards)"
        )
    if fmt == "hf":
        _check_shard_size(max_shard_size)
    model, config = _rebuilt(meta.identity)
    state = whole_model(meta)
    own = {n for n, _ in model.named_buffers()} - set(model.state_dict())  # not persistent
    state = {k: v for k, v in state.items() if k not in own}  # a pipeline stage saves them
    tied = tied_names(model)
    try:
        model.load_state_dict(state, assign=True)
        retie(model, tied)  # assign=True gave each name its own tensor
    except RuntimeError as exc:
        raise GradmeshError(
            f"checkpoint {meta.checkpoint} does not fit model {name}: {first_line(exc)} "
            f"{str(exc).splitlines()[1].strip() if len(str(exc).splitlines()) > 1 else ''}"
        ) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        if fmt == "hf":
            _save_hf(model, staging, max_shard_size)
        else:
            _save_safetensors(model, staging, config)
        if target.exists():
            target.rmdir()
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return f"{found[0]} ({name}, {len(state)} tensors) written to {out} as {fmt}"


def _rebuilt(identity: dict[str, Any]) -> tuple[nn.Module, dict[str, Any]]:
    """The run's model made again from the checkpoint's identity, and its build settings."""
    from gradmesh.train.config import TrainConfig
    from gradmesh.train.setup import load_data, model_of

    keys = ("model", "model_args", "dataset", "sequence_length", "synthetic_shape")
    settings = {k: identity[k] for k in keys if k in identity}
    config = TrainConfig.from_mapping(settings, "the checkpoint's identity")
    data = load_data(config)
    model = model_of(config, data)
    return model, {
        "gradmesh_model": config.data.model,
        "model_args": config.data.model_args,
        "dataset": config.data.dataset,
        "vocab": data.num_classes,
        "sequence_length": config.data.sequence_length,
        "input_shape": list(data.input_shape),
    }


def _check_shard_size(size: str) -> None:
    """One line, before the model is made, for a size `save_pretrained` would refuse at the
    end, read by Hugging Face's own parser (decimal GB, binary GiB)."""
    try:
        from transformers.utils.hub import convert_file_size_to_int
    except ImportError:  # moved in another transformers: save_pretrained still says it
        return
    try:
        convert_file_size_to_int(size)
    except ValueError:
        raise GradmeshError(
            f"--max-shard-size {size!r}: expected a whole number and a unit, like 5GB or 500MiB"
        ) from None


def _save_hf(model: nn.Module, folder: Path, max_shard_size: str) -> None:
    from transformers.utils import logging

    logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    net: Any = model.net  # gradmesh.models.hf.CausalLM's Hugging Face model
    net.save_pretrained(str(folder), max_shard_size=max_shard_size)


def _save_safetensors(model: nn.Module, folder: Path, config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    tied = tied_names(model)  # a parameter another name shares: stored once, under the first
    tensors = {
        key: value.detach().contiguous().cpu()
        for key, value in model.state_dict().items()
        if key not in tied
    }
    listed = ",".join(f"{key}={first}" for key, first in tied.items())
    save_file(tensors, str(folder / "model.safetensors"), metadata={"tied": listed})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
