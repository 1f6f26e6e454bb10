"""House rules, checked: packaging under `splitstage`, one-way imports, no cycles, small modules."""

from __future__ import annotations

import ast
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
MAX_LINES = 400
# Allowed first-party imports per layer: flows -> tasks -> pipelines -> splitter.
LAYERS = {
    "splitstage.splitter": {"splitstage.splitter"},
    "splitstage.pipelines": {"splitstage.pipelines", "splitstage.splitter"},
    "splitstage.tasks": {"splitstage.tasks", "splitstage.pipelines", "splitstage.splitter"},
}
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


def imports_of(path: Path, name: str) -> set[str]:
    """Every module an import statement anywhere in the file names (lazy imports included)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
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


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name]} has {lines} lines; split it by job"


def test_imports_go_one_way():
    wrong = []
    for name, targets in GRAPH.items():
        for layer, allowed in LAYERS.items():
            if name == layer or name.startswith(layer + "."):
                first_party = {t for t in targets if t.startswith("splitstage")}
                bad = {t for t in first_party if not any(t.startswith(a) for a in allowed)}
                if layer == "splitstage.splitter":
                    bad |= {t for t in targets if not t.startswith("splitstage")}  # torch, prefect
                if layer == "splitstage.tasks":
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


def test_no_bare_top_level_names_are_installed(tmp_path):
    code = (
        "import importlib.util as u, sys; "
        "bare = [n for n in ('tasks', 'flows', 'pipelines', 'splitter') if u.find_spec(n)]; "
        "import splitstage.tasks.plan, splitstage.flows, splitstage.splitter; "
        "sys.exit(f'bare import names installed: {bare}' if bare else 0)"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr or run.stdout
