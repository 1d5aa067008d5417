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
    # took resolve_run from __main__); the run lookup now lives in training/export.py.
    ("training/generate.py", "training.__main__"),
]

# training/rollout/ (generation for training) sits below the objectives and the command-line
# tools that use it: it imports nothing of training but itself.
ROLLOUT = "training/rollout"


# The command-line entry points of lower layers (``python -m data``, ``python -m experiments``)
# sit above every layer, as train.py does: before they read a config they may import the one
# module that registers the objective kinds and the model family's names with core.config.
ENTRY_POINT_IMPORTS = {
    "data/__main__.py": {"training.registry", "training.registry.register_all"},
    "experiments/__main__.py": {"training.registry", "training.registry.register_all"},
}


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
        allowed = ENTRY_POINT_IMPORTS.get(str(path.relative_to(ROOT)), set())
        for name in imported_modules(path) - allowed:
            top = name.split(".", 1)[0]
            if top in LAYERS and top != layer and top not in ALLOWED[layer]:
                offences.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offences, "imports from a higher layer:\n" + "\n".join(sorted(offences))


@pytest.mark.parametrize(("module", "forbidden"), FORBIDDEN_PAIRS)
def test_training_modules_that_must_not_import_each_other(module, forbidden):
    names = imported_modules(ROOT / module)
    hits = sorted(n for n in names if n == forbidden or n.startswith(forbidden + "."))
    assert not hits, f"{module} imports {hits}"


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / ROLLOUT).rglob("*.py")))
def test_the_rollout_room_imports_nothing_of_training_above_it(path):
    hits = sorted(n for n in imported_modules(ROOT / path)
                  if n.startswith("training.") and not n.startswith(ROLLOUT.replace("/", ".") + "."))
    assert not hits, f"{path} imports {hits}"


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
