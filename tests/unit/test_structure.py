"""The package's shape, as the design asks for it: modules small enough to read in one sitting, imports
that go one way (no cycle between subpackages, nor between modules), and the tensor manager's components
free of each other's private members. Computed from the source (AST). Classes have no line cap: a class is
split where its concerns part, never to meet a line count."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_greedysnake

PACKAGE = Path(lightning_greedysnake.__file__).parent
MAX_MODULE_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Modules of this package that ``name`` imports anywhere (functions and ``TYPE_CHECKING`` blocks too:
    a cycle through annotations is still two modules that each need the other to be read);
    ``from pkg import sub`` counts as importing ``pkg.sub`` when that is a module."""
    tree = ast.parse(path.read_text())
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the module ``pkg.sub`` (the package itself only for names)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _unit_of(module: str) -> str:
    """The subpackage (or top-level module) a module belongs to."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_no_module_is_longer_than_one_sitting():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, long


def test_no_import_cycle_between_modules():
    assert _cycle(_graph()) is None


def test_no_import_cycle_between_subpackages():
    units: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        units.setdefault(_unit_of(module), set()).update(
            _unit_of(t) for t in targets if _unit_of(t) != _unit_of(module))
    assert _cycle(units) is None


def test_the_stepper_and_the_tensor_manager_do_not_import_each_other():
    graph = _graph()
    optim = {t for m, ts in graph.items() if m.startswith("lightning_greedysnake.optim") for t in ts}
    offload = {t for m, ts in graph.items() if m.startswith("lightning_greedysnake.offload") for t in ts}
    assert not any(t.startswith("lightning_greedysnake.offload") for t in optim), optim
    assert not any(t.startswith("lightning_greedysnake.optim") for t in offload), offload


def test_the_planner_reads_no_settings_and_no_tier():
    """``planner/`` is the probes and the arithmetic: the strategy's planning gathers the measurements, the
    model's sizes and the settings and hands them down (setup's plan in one call); nothing of ``planner/``
    reads them back. It imports nothing of the package but itself, the kinds' names, the schedules (pure op
    lists: what an order costs is derived from its ops, never from its name) and, for the disk probe, the
    I/O engine."""
    graph = _graph()
    planner = {m for m in graph if m.startswith("lightning_greedysnake.planner")}
    reached = {t for m in planner for t in graph[m]} - planner
    assert reached <= {"lightning_greedysnake.kinds", "lightning_greedysnake.io", "lightning_greedysnake.schedule"}, reached
    assert "lightning_greedysnake.planner.setup" in planner  # (the check sees the planner's modules)


def test_the_model_protocol_does_not_know_its_adapters():
    assert not {t for t in _graph()["lightning_greedysnake.models.protocol"] if "hf" in t}


def test_only_the_strategy_modules_precision_and_recipes_import_lightning():
    """The package's top (which registers the strategy names), ``precision``, ``strategy/`` and the
    ``recipes/`` (LightningModules and DataModules for the examples) import Lightning; nothing below them."""
    exact = {"lightning_greedysnake", "lightning_greedysnake.precision"}
    subpackages = ("lightning_greedysnake.strategy", "lightning_greedysnake.recipes")
    importers = set()
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m == "lightning" or m.startswith("lightning.") for m in mods):
                importers.add(name)
    outside = {m for m in importers
               if m not in exact and not any(m == a or m.startswith(a + ".") for a in subpackages)}
    assert not outside, outside
    assert "lightning_greedysnake.strategy.greedysnake" in importers  # (the check sees imports at all)


def test_consumers_of_the_tensor_manager_read_no_private_member():
    """checkpoint, distributed, telemetry and the planner's measurements take a Protocol of public members
    (not ``manager: Any``), and read no private member of it."""
    consumers = ["checkpoint/streamed.py", "distributed.py", "telemetry.py", "strategy/planning/placement.py",
                 "checkpoint/optimizer_state.py"]
    for rel in consumers:
        source = (PACKAGE / rel).read_text()
        assert "manager: Any" not in source, rel
        tree = ast.parse(source)
        private = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                   and n.attr.startswith("_") and not n.attr.startswith("__")
                   and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))]
        assert not private, (rel, private)


def test_the_optimizer_step_has_one_owner():
    """The strategy's optimizer_step (Lightning's seam) runs the window's step; the precision plugin keeps
    the dtype policy and routes clipping, and holds no callback into the strategy."""
    import inspect

    from lightning_greedysnake import GreedySnakePrecision, GreedySnakeStrategy

    assert "optimizer_step" in GreedySnakeStrategy.__dict__
    assert "optimizer_step" not in GreedySnakePrecision.__dict__ and not hasattr(GreedySnakePrecision, "attach")
    source = inspect.getsource(inspect.getmodule(GreedySnakePrecision))
    assert "Callable" not in source  # (no callback field of any kind)
