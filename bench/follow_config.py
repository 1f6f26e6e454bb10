"""Follow the job config through a checkout, statically (ast only; nothing analysed is imported).

    python bench/follow_config.py [--tree PATH]

Issue 23's figures ("following `config` from `launch.train` visits N files and comes back to a
file it had left M times"; "K functions take (config, plan) or (config, family)") as this tool
counts them, so a tree before and after a reorganisation is measured the same way.

Modules map to files through the tree's pyproject (`[tool.setuptools] packages` and
`package-dir`). The walk is depth-first from an entry function; each function is visited once.
Rules (name-based on purpose, so they stay simple and apply the same to any tree):

- A *carrier* expression holds the config: a name `config`; a parameter that received a carrier
  at the call that led here; a local assigned from a carrier (`cfg = config`); any attribute
  named `.config` (`plan.config`, `self.config`); `self.X` where some method of the class did
  `self.X = <carrier>`; a subscript of a carrier (`spec["config"]`). With `plan` mode on, the
  name `plan` and attributes `.plan` are carriers too (the plan holds the config).
- A call is followed when one of its arguments is a carrier, or when it is a method call on an
  object that holds the config (`self.m()` in a class that stored a carrier on self;
  `x.m()` / `Cls(...).m()` where `x = Cls(<carrier>)`).
- The callee is resolved through the module: local names (`x = Name`, imports inside the
  function; every binding is a candidate), same-module functions and classes, from-imports and
  module attributes (re-exports followed); a class means its `__init__` (or just the class's file
  when it has none), methods are looked up through the bases. Anything outside the package is
  not followed; process boundaries (torchrun, a `python -m` child) are not followed either, nor
  dynamic seams (the family registry: `family_class(name)(config)`; methods on objects whose
  class the walk did not see built), nor sub-configs passed alone (`config.train`). Nested
  functions and lambdas count as part of the function that contains them.
- Files are recorded as visited: the callee's file on entry and the caller's again after each
  callee returns. "returns" = transitions A -> B (B != A) into a file seen earlier in the walk.
  A row with several entries walks them one after the other with one visited set.
"""

from __future__ import annotations

import argparse
import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = {  # row: candidate (module, qualname, carrier params) lists, the first one found wins
    "launcher: launch.train": [
        [("splitstage.tasks.launch.launcher", "train", {"config"})],  # one road (issue 34)
        [("splitstage.tasks.stage2.launch", "train", {"config"})],
        [("splitstage.tasks.launch", "train", {"config"})],
    ],
    "launcher + prepare child": [  # trees with a set-up child (issues 25 to 34)
        [
            ("splitstage.tasks.stage2.launch", "train", {"config"}),
            ("splitstage.tasks.stage2.prepare", "prepare", {"config"}),
        ]
    ],
    "rank: set-up, Trainer(...).run()": [
        [  # one road: the rank sets up once, the trainer takes what it made
            ("splitstage.tasks.stage2.rank_setup", "set_up_rank", {"spec"}),
            ("splitstage.tasks.stage2.trainer", "Trainer.__init__", {"setup"}),
            ("splitstage.tasks.stage2.trainer", "Trainer.run", set()),
        ],
        [
            ("splitstage.tasks.stage2.trainer", "Trainer.__init__", {"spec"}),
            ("splitstage.tasks.stage2.trainer", "Trainer.run", set()),
        ],
    ],
}


def module_files(root: Path) -> dict[str, Path]:
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool.get("package-dir", {})
    found = {}
    for package in tool["packages"]:
        parts = package.split(".")
        for cut in range(len(parts), 0, -1):  # the longest mapped prefix gives the folder
            prefix = ".".join(parts[:cut])
            if prefix in dirs:
                folder = root / dirs[prefix] / Path(*parts[cut:])
                break
        else:
            folder = root / Path(*parts)
        for file in sorted(folder.glob("*.py")):
            found[package if file.stem == "__init__" else f"{package}.{file.stem}"] = file
    return found


class Module:
    def __init__(self, name: str, path: Path, is_package: bool):
        self.name, self.path = name, path
        self.tree = ast.parse(path.read_text(), str(path))
        self.defs: dict[str, ast.AST] = {}  # "f", "Cls", "Cls.m"
        self.imports: dict[str, str] = {}  # local name -> dotted target
        base = name if is_package else name.rpartition(".")[0]
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.defs[node.name] = node
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        self.defs[f"{node.name}.{item.name}"] = item
        for node in ast.walk(self.tree):  # imports anywhere (lazy ones too)
            self.imports.update(import_names(node, base))


def import_names(node: ast.AST, base: str) -> dict[str, str]:
    if isinstance(node, ast.Import):
        return {
            a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
            for a in node.names
        }
    if isinstance(node, ast.ImportFrom):
        source = node.module or ""
        if node.level:
            up = base.split(".")[: len(base.split(".")) - node.level + 1]
            source = ".".join(up + ([source] if source else []))
        return {a.asname or a.name: f"{source}.{a.name}" for a in node.names}
    return {}


class Walker:
    def __init__(self, modules: dict[str, Module], plan_mode: bool):
        self.modules, self.plan_mode = modules, plan_mode
        self.names = {"config", "plan"} if plan_mode else {"config"}
        self.visited: dict[tuple[str, str], None] = {}  # in visiting order
        self.files: list[Path] = []
        self.objects: dict = {}  # class -> {"self.x": classes built from the config}
        self.class_attrs: dict[tuple[str, str], set[str]] = {}  # class -> self attrs with config

    def resolve(self, dotted: str, depth: int = 0) -> tuple[str, str] | None:
        """(module, qualname) for a dotted name inside the package, following re-exports."""
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = self.modules.get(".".join(parts[:cut]))
            if module is None:
                continue
            rest = ".".join(parts[cut:])
            if not rest or rest in module.defs:
                return (module.name, rest) if rest else None
            head, _, tail = rest.partition(".")
            if head in module.imports and depth < 8:
                return self.resolve(".".join(filter(None, [module.imports[head], tail])), depth + 1)
            return None
        return None

    def method(self, cls: tuple[str, str], name: str, depth: int = 0) -> tuple[str, str] | None:
        module = self.modules[cls[0]]
        if f"{cls[1]}.{name}" in module.defs:
            return cls[0], f"{cls[1]}.{name}"
        node = module.defs.get(cls[1])
        for base in getattr(node, "bases", []) if depth < 8 else []:
            found = self.callee(module, ast.unparse(base), {})
            hits = [self.method(b, name, depth + 1) for b in found if self.is_class(b)]
            if hits := [h for h in hits if h]:
                return hits[0]
        return None

    def is_class(self, target: tuple[str, str]) -> bool:
        return isinstance(self.modules[target[0]].defs.get(target[1]), ast.ClassDef)

    def qualify(self, module: Module, expr: ast.AST, local: dict) -> list[str]:
        """The dotted names (module path included) an expression names, as far as known."""
        head, _, tail = ast.unparse(expr).partition(".")
        if head in local:
            heads = local[head]
        elif head in module.defs:
            heads = [f"{module.name}.{head}"]
        else:
            heads = [module.imports[head]] if head in module.imports else []
        return [".".join(filter(None, [h, tail])) for h in heads]

    def callee(self, module: Module, dotted: str, local: dict) -> list[tuple[str, str]]:
        try:
            expr = ast.parse(dotted, mode="eval").body
        except SyntaxError:
            return []
        return [t for d in self.qualify(module, expr, local) if (t := self.resolve(d))]

    def walk(self, target: tuple[str, str], carried: set[str]) -> bool:
        if target in self.visited:
            return False
        self.visited[target] = None
        module = self.modules[target[0]]
        node = module.defs[target[1]]
        self.files.append(module.path)
        if isinstance(node, ast.ClassDef):
            return True
        cls = (module.name, target[1].rpartition(".")[0]) if "." in target[1] else None
        attrs = self.class_attrs.setdefault(cls, set()) if cls else set()
        tracked, local, instances = set(carried), {}, {}  # instances: "x" -> classes
        objects = self.objects.setdefault(cls, {}) if cls else {}  # "self.x" -> classes
        base = module.name if module.path.stem == "__init__" else module.name.rpartition(".")[0]

        def carrier(expr: ast.AST) -> bool:
            if isinstance(expr, ast.Name):
                return expr.id in tracked or expr.id in self.names
            if isinstance(expr, ast.Attribute):
                on_self = isinstance(expr.value, ast.Name) and expr.value.id == "self"
                return expr.attr in self.names or (on_self and expr.attr in attrs)
            if isinstance(expr, ast.Subscript | ast.Starred):
                return carrier(expr.value)
            return False

        def built(call: ast.AST) -> list[tuple[str, str]]:
            """The classes a constructor call given a carrier builds (objects holding config)."""
            if not isinstance(call, ast.Call):
                return []
            if not any(carrier(a) for a in [*call.args, *(k.value for k in call.keywords)]):
                return []
            return [
                c for c in self.callee(module, ast.unparse(call.func), local) if self.is_class(c)
            ]

        for sub in post_order(node):  # execution order: arguments before the call
            for name, dotted in import_names(sub, base).items():
                local.setdefault(name, []).append(dotted)
            if isinstance(sub, ast.Assign) and len(sub.targets) == 1:
                left, right = sub.targets[0], sub.value
                if isinstance(left, ast.Name) and carrier(right):
                    tracked.add(left.id)
                elif isinstance(left, ast.Name) and built(right):
                    instances[left.id] = built(right)
                elif isinstance(left, ast.Name) and isinstance(right, ast.Name | ast.Attribute):
                    local.setdefault(left.id, []).extend(self.qualify(module, right, local))
                is_self = isinstance(left, ast.Attribute) and ast.unparse(left.value) == "self"
                if is_self and built(right):
                    objects[ast.unparse(left)] = built(right)
                if is_self and cls and (carrier(right) or left.attr in self.names):
                    attrs.add(left.attr)
            if not isinstance(sub, ast.Call):
                continue
            args = [i for i, a in enumerate(sub.args) if carrier(a)]
            kwargs = {k.arg for k in sub.keywords if k.arg and carrier(k.value)}
            func, targets, holder = sub.func, [], False
            if isinstance(func, ast.Attribute):
                owner = func.value
                if isinstance(owner, ast.Name) and owner.id == "self" and cls:
                    targets, holder = [self.method(cls, func.attr)], bool(attrs)
                elif (held := {**instances, **objects}.get(ast.unparse(owner))) is not None:
                    targets, holder = [self.method(c, func.attr) for c in held], True
                elif isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super" and cls:
                    bases = getattr(module.defs[cls[1]], "bases", [])
                    found = [c for b in bases for c in self.callee(module, ast.unparse(b), local)]
                    targets, holder = [self.method(c, func.attr) for c in found], bool(attrs)
                elif built(owner):
                    targets, holder = [self.method(c, func.attr) for c in built(owner)], True
            if not (args or kwargs or holder):
                continue
            targets = targets or self.callee(module, ast.unparse(func), local)
            for found in filter(None, targets):
                if self.is_class(found):
                    found = self.method(found, "__init__") or found
                callee = self.modules[found[0]].defs[found[1]]
                params = [a.arg for a in callee.args.args] if hasattr(callee, "args") else []
                method = "." in found[1] and params[:1] in (["self"], ["cls"])
                params = params[1:] if method else params
                names = {params[i] for i in args if i < len(params)} | kwargs
                if self.walk(found, names):
                    self.files.append(module.path)
        return True


def post_order(node: ast.AST):
    for child in ast.iter_child_nodes(node):
        yield from post_order(child)
    yield node


def load(root: Path) -> dict[str, Module]:
    return {
        name: Module(name, path, path.stem == "__init__")
        for name, path in module_files(root).items()
    }


def returns(files: list[Path]) -> int:
    seen, count = set(), 0
    for before, after in zip([None, *files], files):
        if after != before and after in seen:
            count += 1
        seen.add(after)
    return count


def paired(modules: dict[str, Module]) -> tuple[int, int, int]:
    """Functions (every def, methods and nested ones too) with config and plan / family params."""
    plan = family = either = 0
    for module in modules.values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                names = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
                has = "config" in names
                plan += has and "plan" in names
                family += has and "family" in names
                either += has and bool(names & {"plan", "family"})
    return plan, family, either


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=ROOT, help="a checkout root")
    parser.add_argument("--files", action="store_true", help="list each walk's files")
    options = parser.parse_args()
    root = options.tree.resolve()
    modules = load(root)
    print(f"tree {root}: {len(modules)} modules")
    print(f"{'walk':34} {'mode':12} {'functions':>9} {'files':>5} {'returns':>7}")
    for row, candidates in ENTRIES.items():
        entries = next((c for c in candidates if all(m in modules for m, _, _ in c)), None)
        if entries is None:
            print(f"{row:34} (entry not in this tree)")
            continue
        for plan_mode in (False, True):
            walker = Walker(modules, plan_mode)
            for module, qualname, carried in entries:
                walker.walk((module, qualname), carried)
            mode = "config+plan" if plan_mode else "config"
            files = walker.files
            print(
                f"{row:34} {mode:12} {len(walker.visited):9} {len(set(files)):5} {returns(files):7}"
            )
            if options.files and not plan_mode:
                for module, qualname in walker.visited:
                    print(f"    {modules[module].path.relative_to(root)}: {qualname}")
    plan, family, either = paired(modules)
    print(f"defs with (config, plan): {plan}; (config, family): {family}; either: {either}")


if __name__ == "__main__":
    main()
