"""Configuration, registries and the worker grid reject bad input with one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradmesh.errors import GradmeshError
from gradmesh.models.registry import MODELS
from gradmesh.registry import Registry
from gradmesh.runtime.axes import MeshShape
from gradmesh.train.checks import check_train
from gradmesh.train.config import TrainConfig
from gradmesh.units import parse_shape, parse_size


def test_registry_lists_valid_names_on_unknown() -> None:
    reg: Registry[int] = Registry("widget")
    reg.register("b")(1)
    reg.register("a")(2)
    with pytest.raises(GradmeshError, match=r"unknown widget 'c' \(valid: a, b\)"):
        reg.get("c")
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a")(3)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"strategy": "nope"},
            "unknown strategy 'nope' (valid: allreduce, diloco, hogwild, local-sgd, ps)",
        ),
        (
            {"model": "resnet"},
            "unknown model 'resnet' (valid: alexnet, alexnet-imagenet, bag, cnn, gpt, inception3, "
            "linear, mlp, residual, resnet101, resnet50, vgg16)",
        ),
        (
            {"dataset": "imagenet"},
            "unknown dataset 'imagenet' (valid: digits, docstrings, synthetic, text)",
        ),
        ({"allreduce": "magic"}, "unknown allreduce algorithm 'magic'"),
        (
            {"replica_group": 3, "replica_groups": 3, "lighthouse": "h:1"},
            "--replica-group must be in 0..2 (--replica-groups 3), got 3",
        ),
        (
            {"replica_group": 0, "replica_groups": 2, "lighthouse": "nowhere"},
            "--replica-group needs --lighthouse HOST:PORT, got 'nowhere'",
        ),
        (
            {"replica_group": 0, "replica_groups": 2, "lighthouse": "h:1", "strategy": "ps"},
            "--replica-group runs synchronous data parallelism (any layout) inside each group, "
            "averaged every step (--strategy allreduce) or every --sync-every steps (--strategy "
            "diloco) across them; not with --strategy ps (yet)",
        ),
        ({"eval_every": 5, "strategy": "hogwild"}, "--eval-every needs the replicas to score"),
        ({"strategy": "diloco", "outer_momentum": 1.0}, "--outer-momentum in [0, 1)"),
        ({"workers": 0}, "--workers must be >= 1, got 0"),
        ({"workers": 4, "batch_size": 3}, "global batch 3 is smaller than the number of workers 4"),
        ({"lr": 0.0}, "--lr must be > 0, got 0.0"),
        ({"timeout_s": -1.0}, "--timeout-s must be > 0, got -1.0"),
        ({"momentum": 1.0}, "--momentum must be in [0, 1), got 1.0"),
        ({"weight_decay": -0.1}, "--weight-decay must be >= 0, got -0.1"),
        ({"synthetic_shape": "3xy"}, "bad shape '3xy'"),
        ({"emulate_compute_ms": -1.0}, "--emulate-compute-ms must be >= 0, got -1.0"),
        (
            {"emulate_compute_ms": 5.0, "tensor_parallel": 2},
            "--emulate-compute-ms spreads one step's compute over the model's whole layers",
        ),
        (
            {"workers": 2, "pipeline_parallel": 2, "microbatches": 3, "schedule": "interleaved"},
            "--microbatches 3: the interleaved schedule sends micro-batches through a rank's "
            "chunks in groups of --pipeline-parallel 2; give a multiple of 2",
        ),
        (
            {"workers": 2, "pipeline_parallel": 2, "microbatches": 4}
            | {"schedule": "interleaved", "virtual_stages": 1},
            "--virtual-stages 1: the interleaved schedule holds at least 2 chunks",
        ),
        pytest.param(
            {"precision": "fp16"},
            "--precision fp16 needs a GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs fp16"),
        ),
        (
            {"precision": "fp16", "strategy": "ps"},
            "--precision fp16 with --strategy ps: its loss scale skips a step only when every",
        ),
        (
            {"precision": "fp16", "compression": "int8"},
            "--precision fp16 with --compression int8: the gradients it compresses are scaled",
        ),
        ({"activation_checkpointing": "every:x"}, "expected blocks (every block), every:K"),
    ],
)
def test_validate_rejects(change: dict[str, object], message: str) -> None:
    config = TrainConfig.of(**change)
    with pytest.raises(GradmeshError) as err:
        check_train(config)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_defaults_are_valid_and_round_trip_through_json() -> None:
    config = TrainConfig()
    check_train(config)
    import json

    assert TrainConfig.from_mapping(json.loads(config.to_json()), "json") == config


def test_toml_fills_fields_and_rejects_unknown_keys(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[train]\nworkers = 3\nmodel = "mlp"\nlr = 0.2\n')
    config = TrainConfig.from_toml(str(good))
    assert (config.job.workers, config.data.model, config.optimizer.lr) == (3, "mlp", 0.2)
    nested = tmp_path / "nested.toml"  # the same names, in tables by component
    nested.write_text('[train.job]\nworkers = 3\n[train.sync.ps]\nmode = "SSP"\nservers = 2\n')
    config = TrainConfig.from_toml(str(nested))
    assert (config.job.workers, config.sync.ps.mode, config.sync.ps.servers) == (3, "ssp", 2)
    for text, key in (
        ("[train.job]\nwrokers = 3\n", "job.wrokers"),
        ("[train.sync.ps]\nmode = 1\n", ""),
    ):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(GradmeshError, match=key or "mode must be a string, got 1"):
            TrainConfig.from_toml(str(bad))
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nwrokers = 3\n")
    with pytest.raises(GradmeshError, match="unknown option.*wrokers"):
        TrainConfig.from_toml(str(bad))


def test_parse_size_takes_binary_units_and_refuses_nothing() -> None:
    assert (parse_size("4KB"), parse_size("2mb"), parse_size("3")) == (4096, 2 << 20, 3)
    for bad, why in (("0MB", "more than 0 bytes"), ("-5", "expected a number"), ("4TB", "")):
        with pytest.raises(GradmeshError, match=f"bad size '{bad}': .*{why}"):
            parse_size(bad)


def test_parse_shape() -> None:
    assert parse_shape("3x32x32") == (3, 32, 32)
    with pytest.raises(GradmeshError):
        parse_shape("0x3")


def test_mesh_shape_puts_tensor_parallel_ranks_innermost() -> None:
    shape = MeshShape.for_world(8, tp=2, pp=2)
    assert (shape.dp, shape.pp, shape.tp) == (2, 2, 2)
    assert shape.coords(5) == {"dp": 1, "pp": 0, "ep": 0, "cp": 0, "tp": 1}
    assert shape.lines("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.lines("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.lines("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # context parallelism inside the experts' axis, both inside the pipeline, tp innermost
    shape = MeshShape.for_world(16, tp=2, cp=2, ep=2)
    assert shape.coords(13) == {"dp": 1, "pp": 0, "ep": 1, "cp": 0, "tp": 1}
    assert shape.lines("cp")[:2] == [[0, 2], [1, 3]]
    assert shape.lines(("dp", "ep", "cp"))[0] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert shape.lines(("dp", "ep"))[1:3] == [[1, 5, 9, 13], [2, 6, 10, 14]]
    assert shape.spanned(("dp", "pp", "cp")) == ("dp", "cp")
    assert shape.describe() == "dp 2 x ep 2 x cp 2 x tp 2"
    with pytest.raises(
        GradmeshError, match=r"6 workers cannot hold .* = 4 ranks: .* \(1, 2, 3, 6\)"
    ):
        MeshShape.for_world(6, tp=4)
    with pytest.raises(GradmeshError, match="must be >= 1"):
        MeshShape.for_world(4, tp=0)


def test_a_mesh_is_a_mapping_of_axes_checked_once() -> None:
    from gradmesh.layout.config import LAYOUT_KEYS, RESHARDABLE, LayoutConfig
    from gradmesh.runtime.world import _mesh_sizes

    shape = MeshShape.for_world(8, **{"tp": 2, "pp": 2})
    assert shape == MeshShape.of({"dp": 2, "pp": 2, "tp": 2})
    assert shape.as_dict() == {"dp": 2, "pp": 2, "ep": 1, "cp": 1, "tp": 2} and shape.split == 4
    assert shape.describe() == "dp 2 x pp 2 x tp 2"
    assert all(shape.rank_of(shape.coords(r)) == r for r in range(8))
    with pytest.raises(
        GradmeshError, match=r"unknown mesh axis 'sp' \(the mesh's axes: dp, pp, ep, cp, tp\)"
    ):
        MeshShape.of({"sp": 2})
    with pytest.raises(GradmeshError, match=r"a mesh of 3 data-parallel replicas x .* is 12 ranks"):
        MeshShape.for_world(8, dp=3, tp=2, pp=2)
    # the options name the axes' sizes; the checkpoint's layout keys come from the same table
    assert LayoutConfig(tensor_parallel=2).mesh_sizes() == {"pp": 1, "ep": 1, "cp": 1, "tp": 2}
    assert LAYOUT_KEYS == (
        "workers",
        "pipeline_parallel",
        "expert_parallel",
        "context_parallel",
        "tensor_parallel",
        "zero_stage",
    )
    assert "pipeline_parallel" not in RESHARDABLE and "tensor_parallel" in RESHARDABLE
    assert "expert_parallel" not in RESHARDABLE and "context_parallel" in RESHARDABLE
    assert _mesh_sizes({"tp": 2}, 1, 1) == {"tp": 2}
    assert _mesh_sizes(None, 2, 1) == {"tp": 2}
    with pytest.raises(GradmeshError, match="not both"):
        _mesh_sizes({"tp": 2}, 2, 1)


@pytest.mark.parametrize("name", ["cnn", "mlp", "linear"])
def test_models_accept_other_input_shapes(name: str) -> None:
    import torch

    model = MODELS.get(name)((3, 12, 10), 5)
    assert model(torch.zeros(2, 3, 12, 10)).shape == (2, 5)


def test_an_engine_whose_extra_is_missing_names_the_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib

    from gradmesh.launch.engines.choice import check_engine

    real = importlib.import_module

    def without_engines(name: str, *args: object) -> object:
        if name.startswith(("ray", "pyspark")):
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_engines)
    with pytest.raises(
        GradmeshError, match=r"--engine ray needs Ray Train: pip install 'gradmesh\[ray\]'"
    ):
        check_engine("ray")
    with pytest.raises(GradmeshError, match=r"pip install 'gradmesh\[spark\]'"):
        check_engine("spark")
    check_engine("local")


def test_an_elastic_job_refuses_what_makes_replicas_differ() -> None:
    """Any rank of an elastic job may resume from any replica's part: ZeRO gives each replica a
    part of its own (a checkpoint of it would resume ranks with another rank's optimizer
    state), so it is refused, as tensor parallelism is."""
    config = TrainConfig.of(checkpoint_dir="ckpt", max_restarts=1)
    config.check_elastic()  # plain data parallelism: each replica holds the same state
    for stage in (1, 2, 3):
        with pytest.raises(GradmeshError, match=f"--zero-stage {stage} gives each replica"):
            TrainConfig.of(checkpoint_dir="ckpt", max_restarts=1, zero_stage=stage).check_elastic()


def test_a_command_line_builds_only_its_own_command_s_options() -> None:
    """`gradmesh train ...` does not import the benchmarks', the planner's or the simulator's
    modules to build options it will not parse (a second of every launcher's start), while
    `gradmesh --help` still lists every command."""
    import subprocess
    import sys

    code = (
        "import sys; from gradmesh.cli import build_parser; "
        "build_parser(['train', '--epochs', '1']).parse_args(['train', '--epochs', '1']); "
        "print(sorted(m for m in sys.modules if m.startswith(('gradmesh.bench', "
        "'gradmesh.plan', 'gradmesh.simulate'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    from gradmesh.cli import build_parser

    listed = build_parser(["train"]).format_help()
    assert "{run,train,emulate,plan,simulate,report,lighthouse,export,bench}" in listed


def test_the_options_and_the_priced_layout_convert_both_ways() -> None:
    """`LayoutConfig.at` gives the planner's and the simulator's `Layout`; its `options()` are
    the trainer's own again, and its flags what `gradmesh plan` prints."""
    from gradmesh.layout.config import LayoutConfig

    config = LayoutConfig(
        tensor_parallel=2,
        pipeline_parallel=2,
        microbatches=4,
        schedule="interleaved",
        activation_checkpointing="blocks",
    )
    lay = config.at(8, zero_stage=1)
    assert (lay.dp, lay.tp, lay.pp, lay.chunks, lay.checkpointing) == (2, 2, 2, 2, True)
    assert lay.name == "dp2xtp2xpp2ixm4xz1xac"
    back = LayoutConfig(**{k: v for k, v in lay.options().items() if k != "zero_stage"})
    assert back.at(8, lay.options()["zero_stage"]) == lay
    assert lay.flags() == (
        "--tensor-parallel 2 --pipeline-parallel 2 --microbatches 4 --schedule interleaved "
        "--virtual-stages 2 --zero-stage 1 --activation-checkpointing blocks"
    )
    assert LayoutConfig().at(4).flags() == "(data parallel: no layout flags)"
