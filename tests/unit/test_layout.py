"""House rules, checked: packaging under `splitstage`, rooms whose imports go one way, no cycles,
no module name shared across rooms.

The rooms, lowest first; a room imports only from itself and the rooms below it:
- `splitstage.splitter`: the split algorithm; pure Python (neither torch nor prefect).
- `splitstage.process`: process helpers (leaving a process, liveness, trimming unused imports).
- `splitstage.storage`: URLs, storage options, credentials, fsspec I/O, safetensors headers,
  the run lease.
- `splitstage.config`: the job config's typed groups and the family registry (torch-free).
- `splitstage.data`: data sets: rows, images, buckets, the data index and its memos.
- `splitstage.pipelines`: the family seam, shared recipe maths and one folder per family; a family
  folder imports no other family folder, and the shared modules import none.
- `splitstage.tasks`: the work as plain functions: plan, cache, stage1, stage2 (a rank), launch
  (the lean launcher: it imports from stage2 only the run spec and the run's places, and no torch)
  (never prefect).
- `splitstage.flows`: Prefect flows, their task wrappers and artifacts.
- the entry points (`splitstage.cli`, `splitstage.demo`): anything.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Installed import name -> folder in the repository (pyproject's package-dir mapping).
ROOTS = {
    "splitstage": ROOT / "splitstage",
    "splitstage.splitter": ROOT / "splitter",
    "splitstage.pipelines": ROOT / "pipelines",
    "splitstage.tasks": ROOT / "tasks",
    "splitstage.flows": ROOT / "flows",
}
# The rooms, lowest first: each may import itself and those before it (module docstring).
ROOMS = [
    "splitstage.splitter",
    "splitstage.process",
    "splitstage.storage",
    "splitstage.config",
    "splitstage.data",
    "splitstage.pipelines",
    "splitstage.tasks",
    "splitstage.flows",
]
LAYERS = {room: set(ROOMS[: index + 1]) for index, room in enumerate(ROOMS)}
# A module's name says which room it is in: no name repeats across rooms.
NAMED_ROOMS = tuple(ROOMS)
DEMO = "splitstage.pipelines.demo"
DEMO_OWNERS = (DEMO, "splitstage.demo")  # the demo family and its `make demo` runner


def modules() -> dict[str, Path]:
    """Every first-party module by installed name."""
    found = {}
    for prefix, folder in ROOTS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if name.startswith("splitstage.") or prefix == "splitstage":
                found[name] = path
    return found


MODULES = modules()


def imports_of(path: Path, name: str, *, eager: bool = False) -> set[str]:
    """Every module an import statement anywhere in the file names (lazy imports included); with
    `eager`, only the module-level statements' first-party modules (not those inside functions
    or `if TYPE_CHECKING:`): what importing it loads first-hand."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in tree.body if eager else ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    if eager:
        return {m for m in found if m in MODULES}
    return {m for m in found if m in MODULES or m.split(".")[0] in {"torch", "prefect"}}


GRAPH = {name: imports_of(path, name) for name, path in MODULES.items()}


def test_every_package_folder_is_packaged():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packaged = set(config["packages"])
    packages = {n for n, p in MODULES.items() if p.name == "__init__.py"}
    assert packages == packaged, "list every package (folder with __init__.py) in pyproject.toml"
    for name, folder in ROOTS.items():
        if name != "splitstage":
            assert config["package-dir"][name] == folder.name


def test_every_module_lives_in_a_room():
    entry_points = {"splitstage", "splitstage.cli", "splitstage.demo"}
    homeless = [
        name
        for name in MODULES
        if name not in entry_points
        and not any(name == room or name.startswith(room + ".") for room in ROOMS)
    ]
    assert not homeless, f"modules outside every room: {homeless}"


def test_no_module_name_repeats_across_rooms():
    by_name: dict[str, set[str]] = {}
    for name in MODULES:
        room = next((r for r in NAMED_ROOMS if name.startswith(r + ".")), None)
        if room and MODULES[name].name != "__init__.py":
            by_name.setdefault(name.rpartition(".")[2], set()).add(room)
    shared = {base: sorted(rooms) for base, rooms in by_name.items() if len(rooms) > 1}
    assert not shared, f"module names shared across rooms (name each for what it is): {shared}"


def test_imports_go_one_way():
    wrong = []
    for name, targets in GRAPH.items():
        for layer, allowed in LAYERS.items():
            if name == layer or name.startswith(layer + "."):
                first_party = {t for t in targets if t.startswith("splitstage")}
                bad = {t for t in first_party if not any(t.startswith(a) for a in allowed)}
                if layer == "splitstage.splitter":
                    bad |= {t for t in targets if not t.startswith("splitstage")}  # torch, prefect
                if layer != "splitstage.flows":
                    bad |= {t for t in targets if t.startswith("prefect")}
                wrong += [f"{name} imports {t}" for t in sorted(bad)]
    assert not wrong, "; ".join(wrong)


def test_only_the_demo_imports_the_demo():
    wrong = [
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if not name.startswith(DEMO_OWNERS)
        for target in targets
        if target.startswith(DEMO)
    ]
    assert not wrong, "; ".join(wrong)


PIPELINES = "splitstage.pipelines"
# The family folders: each package directly under pipelines/ (demo, diffusers, diffsynth, ...).
FAMILIES = sorted(
    name
    for name, path in MODULES.items()
    if path.name == "__init__.py" and name.rpartition(".")[0] == PIPELINES
)


def family_of(name: str) -> str | None:
    """The family folder a module is in, None for the shared seam and every other room."""
    return next((f for f in FAMILIES if name == f or name.startswith(f + ".")), None)


def test_no_family_imports_another_family():
    """A family folder imports no other family folder (what two share lives in the shared
    modules of pipelines/, e.g. lora_targets.py), and the shared modules import no family:
    generic code calls the family the registry resolved."""
    assert len(FAMILIES) >= 3, FAMILIES  # the scan sees the folders
    wrong = [
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        if name.startswith(PIPELINES + ".")
        for target in targets
        if family_of(target) not in (None, family_of(name))
    ]
    assert not wrong, "; ".join(wrong)


def test_no_import_cycle():
    graph = {n: {t for t in ts if t in MODULES and t != n} for n, ts in GRAPH.items()}
    # A package's __init__ re-exports its modules: that edge is not a cycle of the code.
    graph = {n: {t for t in ts if not n.startswith(t + ".")} for n, ts in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_the_plan_names_a_cache_without_the_cache_room():
    """Importing the plan (which names the cache: its key) loads the fingerprints alone of the
    cache room; the store and everything it reads come when a cache is opened (`open_cache`)."""
    seen, todo = set(), ["splitstage.tasks.job_plan"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [m for m in imports_of(MODULES[name], name, eager=True) if m != name]
    cache = sorted(m for m in seen if m.startswith("splitstage.tasks.cache."))
    assert cache == ["splitstage.tasks.cache.fingerprint"], cache


def test_no_bare_top_level_names_are_installed(tmp_path):
    code = (
        "import importlib.util as u, sys; "
        "bare = [n for n in ('tasks', 'flows', 'pipelines', 'splitter') if u.find_spec(n)]; "
        "import splitstage.tasks.job_plan, splitstage.flows, splitstage.splitter; "
        "sys.exit(f'bare import names installed: {bare}' if bare else 0)"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr or run.stdout


TESTS = ROOT / "tests"
# torchrun worker scripts, not test modules: a test may import their model and plan.
WORKERS = "tests.integration.workers"
# An import line in a string: the code a test runs in a child process (`python -c`).
SCRIPT_IMPORT = re.compile(
    r"^\s*(?:from\s+([\w.]+)\s+import\s+([\w, ]+)|import\s+([\w., ]+))", re.M
)


def imported_test_modules(path: Path) -> set[str]:
    """The `test_*` modules a test file imports, its child scripts' imports included."""
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    targets: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = f"{name.rsplit('.', node.level)[0]}.{base}".rstrip(".")
            # `from tests.unit import test_x` names the module in the alias.
            targets += [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for base, names, modules in SCRIPT_IMPORT.findall(node.value):
                if base:
                    targets += [base] + [f"{base}.{n.strip()}" for n in names.split(",")]
                else:
                    targets += [m.strip() for m in modules.split(",")]
    found = set()
    for target in targets:
        parts = target.split(".")
        hit = next((i for i, part in enumerate(parts) if part.startswith("test_")), None)
        if hit is not None and not target.startswith(WORKERS + "."):
            found.add(".".join(parts[: hit + 1]))
    return found


def test_no_test_module_imports_another():
    """A test module imports no `test_*` module (itself included), nor does a script it runs:
    shared code lives in tests/helpers/ or conftest.py fixtures. tests/integration/workers/ holds
    torchrun worker scripts, not test modules: importing them is allowed."""
    wrong = [
        f"{'.'.join(path.relative_to(ROOT).with_suffix('').parts)} imports {module}"
        for path in sorted(TESTS.rglob("test_*.py"))
        for module in sorted(imported_test_modules(path))
    ]
    assert not wrong, "move shared code to tests/helpers/: " + "; ".join(wrong)


LAUNCHER_ROOM = "splitstage.tasks.launch"
LAUNCHER_MAY_READ = ("splitstage.tasks.stage2.run_spec", "splitstage.tasks.stage2.outputs")


def test_the_launcher_side_reads_only_the_ranks_contract():
    """The launcher room (alive for the whole run, lean) imports from the rank's room only the
    run spec and the run's places, and torch nowhere."""
    found = []
    for name, path in modules().items():
        if not name.startswith(LAUNCHER_ROOM):
            continue
        for imported in imports_of(path, name):
            rank_side = imported.startswith("splitstage.tasks.stage2")
            if (rank_side and imported not in LAUNCHER_MAY_READ) or imported.startswith("torch"):
                found.append(f"{name} imports {imported}")
    assert found == []
