"""The layer rule of DESIGN.md, read from the source (ast, nothing imported): a layer imports only itself and the
layers below it, every onepath import names a module that exists, modules import no cycle (imports inside
functions count), no private name (`_x`) crosses a module boundary, and no test imports bench/ or lab/. Each rule has a negative control: the checker, run on a few synthetic modules that break it, must
name the break."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]

# Layer -> the layers it may import besides itself. cli and bench are the top; train (with the run config) drives
# the engine and reads the tasks; consistency stands beside the stack: it reads every layer and none reads it.
BELOW = {"numerics": set(), "ops": {"numerics"}}
BELOW["models"] = BELOW["ops"] | {"ops"}
BELOW["engine"] = BELOW["models"] | {"models"}
BELOW["tasks"] = BELOW["models"] | {"models"}
BELOW["chat"] = BELOW["tasks"] | {"tasks"}  # chat templates, tool calls: the trainer's and a server's
BELOW["serve"] = BELOW["engine"] | BELOW["chat"] | {"engine", "chat"}  # the HTTP API over an engine
BELOW["train"] = BELOW["serve"] | {"serve"}
BELOW["consistency"] = BELOW["train"] | {"train"}
BELOW["bench"] = BELOW["consistency"] | {"consistency"}
BELOW["cli"] = BELOW["bench"] | {"bench"}
# First name under onepath/ -> its layer, where the two differ.
PLACED = {"__main__": "cli", "config": "train", "user_code": "chat"}
# Folders a test must not import: experiments and user benchmarks are not the product.
OUTSIDE = ("bench", "lab")


class Violation(NamedTuple):
    path: str
    line: int
    rule: str
    message: str

    def __str__(self):
        return f"{self.path}:{self.line}: {self.rule}: {self.message}"


class Import(NamedTuple):
    path: str
    line: int
    target: str          # the module imported, as written (resolved against the importer's package)
    names: tuple = ()    # for `from target import a, b`: the names that are not modules themselves


def module_name(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "onepath" or len(parts) == 1:
        return None
    return PLACED.get(parts[1], parts[1] if parts[1] in BELOW else "unplaced")


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: str, tree: ast.AST, modules: set[str]) -> list[Import]:
    """Every import in the file, at module level or inside functions. An onepath module that does not exist is
    kept under its own name (layer_of places it; check() reports it missing)."""
    module, found = module_name(path), []
    is_package = path.endswith("__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(path, node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            names = []
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.append(Import(path, node.lineno, f"{base}.{alias.name}"))
                else:
                    names.append(alias.name)
            if names:
                found.append(Import(path, node.lineno, base, tuple(names)))
    return found


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return inner and f"{inner}.{node.attr}"
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_attributes(path: str, tree: ast.AST, modules: set[str]) -> list[Violation]:
    """`mod._x` where `mod` is another onepath module bound by an import in this file."""
    module, bound = module_name(path), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    bound[alias.asname] = alias.name
                elif not alias.asname:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path.endswith("__init__.py"), node)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        owner = _dotted(node.value)
        if owner is None or owner.split(".")[0] not in bound:
            continue
        owner = ".".join([bound[owner.split(".")[0]]] + owner.split(".")[1:])
        if owner in modules and owner != module:
            found.append(Violation(path, node.lineno, "private",
                                   f"{owner}.{node.attr} is private to {owner}: make it public (no underscore) "
                                   f"or move the caller's need into {owner}"))
    return found


def _cycles(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in edges.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, {}):
                components.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    cycles = []
    for component in components:
        start = min(component)
        # breadth-first inside the component, back to the start: the shortest cycle through it
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            succs = sorted(s for s in edges.get(path[-1], {}) if s in component)
            if start in succs:
                cycles.append(path + [start])
                break
            for succ in succs:
                if succ not in seen:
                    seen.add(succ)
                    paths.append(path + [succ])
    return cycles


def check(sources: dict[str, str]) -> list[Violation]:
    """Every violation in a tree given as {path relative to the repository root: source}."""
    trees = {path: ast.parse(text, filename=path) for path, text in sources.items()}
    product = {path for path in trees if path.startswith("onepath/")}
    modules = {module_name(path) for path in product}
    path_of = {module_name(path): path for path in product}
    found: list[Violation] = []
    edges: dict[str, dict[str, Import]] = {}
    for path in sorted(product):
        module = module_name(path)
        layer = layer_of(module)
        if layer == "unplaced":
            found.append(Violation(path, 1, "layer", f"{module} is in no layer: place it in tests/test_layers.py's "
                                                     f"BELOW or PLACED, or move it into a layer's folder"))
        for imp in imports(path, trees[path], modules):
            target_layer = layer_of(imp.target)
            if target_layer is None or imp.target == module:
                continue
            if imp.target not in modules:
                found.append(Violation(path, imp.line, "missing", f"imports {imp.target}, which is no module under "
                                                                  f"onepath/: point the import at where it moved"))
                continue
            edges.setdefault(module, {}).setdefault(imp.target, imp)
            if layer in BELOW and target_layer != layer and target_layer not in BELOW[layer]:
                found.append(Violation(path, imp.line, "layer",
                                       f"{layer} imports {imp.target} ({target_layer}); {layer} may import only "
                                       f"{', '.join(sorted(BELOW[layer] | {layer})) or layer}"))
            for name in imp.names:
                if _private(name):
                    found.append(Violation(path, imp.line, "private",
                                           f"imports {name} from {imp.target}: a private name does not cross "
                                           f"modules; make it public or move the need into {imp.target}"))
        found += private_attributes(path, trees[path], modules)
    for cycle in _cycles(edges):
        hops = [f"{a} ({edges[a][b].path}:{edges[a][b].line})" for a, b in zip(cycle, cycle[1:])]
        first = edges[cycle[0]][cycle[1]]
        found.append(Violation(first.path, first.line, "cycle",
                               " -> ".join(hops + [cycle[0]]) + ": move what both need into the lower module"))
    for path in sorted(p for p in trees if p.startswith("tests/")):
        for node in ast.walk(trees[path]):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and _dotted(node.func) in {"importlib.import_module", "import_module"} \
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
            for name in names:
                if name.split(".")[0] in OUTSIDE:
                    found.append(Violation(path, node.lineno, "tests",
                                           f"imports {name}: tests import the product (onepath), never bench/ or "
                                           f"lab/; test the product code the script calls, or move the logic into "
                                           f"onepath"))
    return found


def repository() -> dict[str, str]:
    paths = sorted(ROOT.glob("onepath/**/*.py")) + sorted(ROOT.glob("tests/**/*.py"))
    return {str(path.relative_to(ROOT)): path.read_text() for path in paths}


def _report(rule: str) -> str:
    violations = [v for v in check(repository()) if v.rule == rule]
    return "\n".join(map(str, violations))


# --- the tree -------------------------------------------------------------------------------------------------

def test_layers():
    assert not (report := _report("layer")), "imports against the layer rule (DESIGN.md, Layers):\n" + report


def test_imports_resolve():
    assert not (report := _report("missing")), "imports of onepath modules that do not exist:\n" + report


def test_no_import_cycles():
    assert not (report := _report("cycle")), "import cycles:\n" + report


def test_no_private_names_across_modules():
    assert not (report := _report("private")), "private names used outside their module:\n" + report


def test_tests_do_not_import_bench_or_lab():
    assert not (report := _report("tests")), "tests importing bench/ or lab/:\n" + report


# --- negative controls: the checker sees each kind of break ---------------------------------------------------

def _rules(sources: dict[str, str]) -> list[tuple[str, int, str]]:
    return [(v.path, v.line, v.rule) for v in check(sources)]


CLEAN = {
    "onepath/__init__.py": "",
    "onepath/cli.py": "import onepath.consistency.diff\nfrom onepath.train import loop\n",
    "onepath/train/__init__.py": "",
    "onepath/train/loop.py": "from onepath.tasks.sums import prompt\nfrom onepath.engine.runner import run\n"
                             "from onepath.numerics import diff\n",
    "onepath/tasks/__init__.py": "",
    "onepath/tasks/sums.py": "from onepath.models.dense import Decoder\nprompt = 1\n",
    "onepath/engine/__init__.py": "",
    "onepath/engine/runner.py": "from onepath.models.dense import Decoder\ndef run():\n    from . import sched\n",
    "onepath/engine/sched.py": "from onepath.ops import linear\n",
    "onepath/models/__init__.py": "",
    "onepath/models/dense.py": "from onepath.ops.linear import linear\nDecoder = 1\n",
    "onepath/ops/__init__.py": "from onepath.ops import linear as _linear\n",
    "onepath/ops/linear.py": "from onepath.numerics.spec import Spec\ndef linear(): pass\ndef _tile(): pass\n",
    "onepath/numerics/__init__.py": "",
    "onepath/numerics/spec.py": "Spec = 1\n",
    "onepath/numerics/diff.py": "",
    "onepath/consistency/__init__.py": "",
    "onepath/consistency/diff.py": "from onepath.train.loop import x\nfrom onepath.engine import runner\n",
    "tests/test_x.py": "import onepath.ops.linear\nimport subprocess\n",
}


def test_clean_tree_has_no_violation():
    assert _rules(CLEAN) == []


def test_checker_sees_an_upward_import():
    broken = CLEAN | {"onepath/engine/blocks.py": "", "onepath/ops/linear.py": "def linear():\n    from onepath.engine import blocks\n"}
    assert _rules(broken) == [("onepath/ops/linear.py", 2, "layer")]


def test_checker_sees_an_import_of_consistency():
    broken = CLEAN | {"onepath/consistency/gates.py": "",
                      "onepath/train/loop.py": CLEAN["onepath/train/loop.py"] + "from onepath.consistency import gates\n"}
    assert _rules(broken) == [("onepath/train/loop.py", 4, "layer")]


def test_checker_sees_tasks_importing_train_or_engine():
    broken = CLEAN | {"onepath/train/data.py": "",
                      "onepath/tasks/sums.py": "from onepath.train.data import x\nimport onepath.engine.sched\n"}
    assert _rules(broken) == [("onepath/tasks/sums.py", 1, "layer"), ("onepath/tasks/sums.py", 2, "layer")]


def test_checker_sees_a_module_in_no_layer():
    broken = CLEAN | {"onepath/utils.py": ""}
    assert _rules(broken) == [("onepath/utils.py", 1, "layer")]


def test_checker_sees_an_import_of_a_missing_module():
    broken = CLEAN | {"onepath/models/dense.py": "from onepath.ops.linear_quant import linear\n"}
    assert _rules(broken) == [("onepath/models/dense.py", 1, "missing")]


def test_checker_sees_a_cycle_through_a_function_import():
    broken = CLEAN | {"onepath/engine/sched.py": "from onepath.engine.runner import run\n"}
    violations = check(broken)
    assert [(v.path, v.rule) for v in violations] == [("onepath/engine/runner.py", "cycle")]
    assert "onepath.engine.runner (onepath/engine/runner.py:3) -> onepath.engine.sched" in violations[0].message


def test_checker_sees_private_names_across_modules():
    broken = CLEAN | {"onepath/models/dense.py": "from onepath.ops.linear import _tile\nimport onepath.ops.linear as L\n"
                                                 "from onepath.ops import linear\nL._tile()\nlinear._tile()\n"
                                                 "onepath.ops.linear._tile()\nimport onepath.numerics.spec\n"}
    assert sorted(_rules(broken)) == [("onepath/models/dense.py", n, "private") for n in (1, 4, 5, 6)]


def test_checker_sees_tests_importing_bench_or_lab():
    broken = CLEAN | {"tests/test_x.py": "from bench.kernels import sweep\ndef test():\n    import lab.probe\n"
                                         "    importlib.import_module('bench.rollout')\n"}
    assert _rules(broken) == [("tests/test_x.py", n, "tests") for n in (1, 3, 4)]
