"""The layer rule of docs/architecture.md: each layer imports only the layers below it.

Every module's imports (including those inside functions) are read with ``ast``, so a lazy
import cannot hide a back-arrow. A few module pairs inside ``training`` must not import each
other either (their shared parts live in a module of their own).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ALLOWED = {
    "core": set(),
    "distributed": {"core"},
    "data": {"core"},
    "models": {"core"},
    "experiments": {"core"},
    "runtime": {"core", "experiments"},
    "training": {"core", "distributed", "data", "models", "experiments", "runtime"},
}
LAYERS = set(ALLOWED)

# (module, module it must not import). builders and xla used to import each other (builders
# starts xla_spmd through xla.setup; xla took ParallelPlan from builders); ParallelPlan now
# lives in training/plan.py, so the arrow goes one way only.
FORBIDDEN_PAIRS = [
    ("training/xla.py", "training.builders"),
    ("training/plan.py", "training.builders"),
    ("training/plan.py", "training.xla"),
    # The generate command and the command line's entry point used to import each other (generate
    # took resolve_run from __main__); the run lookup now lives in training/cli/export.py.
    ("training/cli/generate.py", "training.__main__"),
]

# The rooms of training/ (docs/architecture.md draws them): each room imports, of training, only
# itself, the rooms named here and the loop's floor modules named in FLOOR; the table has no
# circle (test below). Modules directly under training/ (the loop, the session, the step...)
# may import every room but cli/, which only the command line's entry point (__main__) imports.
ROOMS = {
    "rollout": set(),  # generation for training: generator, environments, experience
    "optimizers": set(),  # optimizer builders and schedules
    "checkpoint": set(),  # format, manager, resume, loading a run's model
    "record": {"checkpoint"},  # ledger, recorder, replay
    "objectives": {"rollout", "checkpoint"},  # one module per method, plus its settings
    "cli": {"checkpoint", "rollout", "objectives"},  # python -m training's tools
}
FLOOR = {
    "objectives": {"training.step", "training.losses", "training.linear_cross_entropy"},
    "cli": {"training.memory_estimate"},
}
ROLLOUT = "training/rollout"

def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def layer_files():
    for layer in sorted(LAYERS):
        for path in sorted((ROOT / layer).rglob("*.py")):
            yield layer, path


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_layer_imports_only_layers_below_it(layer):
    offences = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for name in imported_modules(path):
            top = name.split(".", 1)[0]
            if top in LAYERS and top != layer and top not in ALLOWED[layer]:
                offences.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offences, "imports from a higher layer:\n" + "\n".join(sorted(offences))


@pytest.mark.parametrize(("module", "forbidden"), FORBIDDEN_PAIRS)
def test_training_modules_that_must_not_import_each_other(module, forbidden):
    names = imported_modules(ROOT / module)
    hits = sorted(n for n in names if n == forbidden or n.startswith(forbidden + "."))
    assert not hits, f"{module} imports {hits}"


def _training_target(name: str) -> str | None:
    """The room (``rollout``...) or floor module (``training.step``) a ``training...`` import names."""
    parts = name.split(".")
    if parts[0] != "training" or len(parts) < 2:
        return None
    if (ROOT / "training" / parts[1]).is_dir():
        return parts[1]
    return f"training.{parts[1]}"


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_each_room_of_training_imports_only_the_rooms_below_it(room):
    offences = []
    for path in sorted((ROOT / "training" / room).rglob("*.py")):
        for name in imported_modules(path):
            target = _training_target(name)
            if target is None or target == room or target in ROOMS[room] or target in FLOOR.get(room, set()):
                continue
            offences.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offences, "imports against the room table:\n" + "\n".join(sorted(offences))


def test_only_the_entry_point_imports_the_command_line_tools():
    offences = []
    for path in sorted((ROOT / "training").glob("*.py")):
        if path.name == "__main__.py":
            continue
        offences += [f"{path.name} imports {n}" for n in imported_modules(path) if _training_target(n) == "cli"]
    assert not offences, "\n".join(offences)


def test_every_room_is_in_the_table_and_the_table_has_no_circle():
    rooms = {p.name for p in (ROOT / "training").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(ROOMS), f"rooms on disk {sorted(rooms)} differ from the table {sorted(ROOMS)}"

    def visit(room: str, path: tuple[str, ...]) -> None:
        assert room not in path, f"circle: {' -> '.join((*path, room))}"
        for below in ROOMS[room]:
            visit(below, (*path, room))

    for room in ROOMS:
        visit(room, ())


def test_the_run_dir_layout_is_defined_once():
    """Run-dir and checkpoint names come from core/layout.py; nobody spells them again."""
    spelled = []
    for _, path in layer_files():
        if path.name == "layout.py" and path.parent.name == "core":
            continue
        text = path.read_text()
        for literal in ('"ledger.jsonl"', '"events.jsonl"', '"metrics.jsonl"', '"step_{', '"data_state.json"'):
            if literal in text:
                spelled.append(f"{path.relative_to(ROOT)}: {literal}")
    assert not spelled, "run-dir names spelled outside core/layout.py:\n" + "\n".join(spelled)


def test_the_checker_sees_a_back_arrow(tmp_path):
    """The reader finds imports at any depth, so the rule above can fail."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from training.loop import Trainer\n    import data.batch\n")
    assert {"training.loop", "training.loop.Trainer", "data.batch"} <= imported_modules(module)
