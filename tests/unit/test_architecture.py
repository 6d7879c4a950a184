"""The tree keeps the shape docs/architecture.md gives it: imports point down the layers and
make no circle, files and functions stay small, `__init__.py` files only re-export, the doc
names only paths that exist, and commands that share an option show the same default."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gradmesh"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the gradmesh modules it imports: every import statement, those inside
    functions and under TYPE_CHECKING too, since they still tie the modules together."""
    files = {module_of(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                prefix = node.module or ""
                if node.level:
                    anchor = base[: len(base) - node.level + 1]
                    prefix = ".".join(anchor + ([node.module] if node.module else []))
                names = [prefix, *(f"{prefix}.{a.name}" for a in node.names)]
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    found.add(name)
        graph[mod] = found
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back_through_others() -> None:
    assert circles(import_graph()) == []


def test_imports_point_down_the_layers() -> None:
    """import-linter's contracts in pyproject.toml: the layers, and no circle between siblings."""
    linter = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert linter is not None, "import-linter is a test dependency (pip install gradmesh[test])"
    out = subprocess.run([linter], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "broken" not in out.stdout.lower().split("contracts:")[-1].split("kept")[0]


def long_functions() -> dict[str, int]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 60:
                    found[f"{path.relative_to(ROOT)}:{node.name}"] = length
    return found


def test_files_and_functions_stay_small() -> None:
    big = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert big == {}
    longer = long_functions()
    assert len(longer) <= 2, longer
    named = ARCHITECTURE.read_text()
    for where in longer:  # each one is named in the architecture doc, with its reason
        assert f"`{where}`" in named, where


def test_init_files_only_re_export() -> None:
    logic = 0
    for path in PACKAGE.rglob("__init__.py"):
        tree = ast.parse(path.read_text())
        logic += sum(
            (s.end_lineno or s.lineno) - s.lineno + 1
            for s in tree.body
            if isinstance(s, (ast.FunctionDef, ast.ClassDef))
        )
    assert logic <= 60


def test_the_architecture_doc_names_only_paths_that_exist() -> None:
    text = ARCHITECTURE.read_text()
    paths = set(re.findall(r"`((?:gradmesh|tests|docs|examples)/[\w/.-]*)`", text))
    assert len(paths) > 20
    missing = sorted(p for p in paths if not (ROOT / p.split(":")[0]).exists())
    assert missing == []


def defaults_in_help(command: list[str]) -> dict[str, str]:
    """Flag -> the default its help shows (or "" when it shows none)."""
    from gradmesh.cli import build_parser

    parser = build_parser()
    sub = parser
    for name in command:
        action = next(a for a in sub._actions if a.dest in ("command", "bench"))
        sub = action.choices[name]  # type: ignore[index]
    shown = {}
    for action in sub._actions:
        for flag in action.option_strings:
            found = re.search(r"\(default: ([^)]*)\)\s*$", action.help or "")
            shown[flag] = found.group(1) if found else ""
    return shown


def test_train_and_simulate_show_the_same_default_for_every_shared_option() -> None:
    train, simulate = defaults_in_help(["train"]), defaults_in_help(["simulate"])
    shared = set(train) & set(simulate) - {"-h", "--help", "--config"}
    assert {"--fusion-mb", "--allreduce", "--tensor-parallel", "--model"} <= shared
    assert {f: (train[f], simulate[f]) for f in shared if train[f] != simulate[f]} == {}


@pytest.mark.parametrize(
    ("old", "new", "name"),
    [
        ("gradmesh.hogwild", "gradmesh.sync.hogwild", "share_model"),
        ("gradmesh.local_sgd", "gradmesh.sync.local_sgd", "Averager"),
        ("gradmesh.parameter_server.cost", "gradmesh.sync.parameter_server.cost", "step_time"),
        ("gradmesh.metrics", "gradmesh.observe.metrics", "Metrics"),
        ("gradmesh.integrations.ray", "gradmesh.launch.engines.ray", "train"),
    ],
)
def test_a_moved_module_still_imports_with_a_deprecation_warning(
    old: str, new: str, name: str
) -> None:
    import importlib

    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moved = importlib.import_module(old)
    assert getattr(moved, name) is getattr(importlib.import_module(new), name)
    assert any(f"{old} is now {new}" in str(w.message) for w in caught)
    assert all(issubclass(w.category, DeprecationWarning) for w in caught)


def test_help_and_the_flag_errors_import_no_torch() -> None:
    """`gradmesh --help`, a command's help and a flag's one-line error come back without
    importing torch (1.2 s a process here): the options, the registries' names and the cost
    formulas they read are torch-free, and the registries import their entries on first lookup."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from gradmesh.cli import build_parser, main\n"
        "build_parser()\n"
        "try:\n"
        "    main(['train', '--workers', '0'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr
    assert "--workers must be >= 1" in out.stderr
