"""No code outside an objective's own modules asks which objective it runs by name.

What the loop, the config checks, export and generate need to know about a method is a
capability it declares (core.objective_kinds.ObjectiveCapabilities, registered by training/registry.py).
A comparison with a kind name (``kind == "grpo"``, ``name != "causal_lm"``, ``kind in ("causal_lm",
"sft")``, ``case "dpo":``) or a literal list of kind names is read with ``ast`` in every module of
the package; only the kind's own modules and the registration site may hold one.
"""

from __future__ import annotations

import ast
from pathlib import Path

from training.registry import OBJECTIVE_KINDS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("core", "data", "distributed", "experiments", "models", "runtime", "training")
KINDS = {kind.name for kind in OBJECTIVE_KINDS}

# A kind's own modules: its objective, its settings, and the modules only it uses.
OWN_MODULES = {
    "causal_lm": {"training/objectives/causal_lm.py", "training/objectives/causal_lm_settings.py"},
    "sft": {"training/objectives/sft.py", "training/objectives/sft_settings.py"},
    "dpo": {"training/objectives/dpo.py", "training/objectives/dpo_settings.py",
            "training/objectives/preference_loss.py", "training/objectives/reference_cache.py"},
    "distill": {"training/objectives/distill.py", "training/objectives/distill_settings.py",
                "training/objectives/distill_loss.py"},
    "grpo": {"training/objectives/grpo.py", "training/objectives/grpo_settings.py",
             "training/objectives/grpo_loss.py", "training/rollout/rewards.py"},
    "ppo": {"training/objectives/ppo.py", "training/objectives/ppo_settings.py", "training/objectives/ppo_loss.py",
            "training/objectives/critic.py"},
    "reward_model": {"training/objectives/reward_model.py", "training/objectives/reward_model_settings.py"},
}
REGISTRATION = "training/registry.py"


def kind_names_compared(source: str) -> list[tuple[int, str]]:
    """(line, kind) for every kind name compared, matched or listed in ``source``."""
    found = []

    def names_in(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and node.value in KINDS:
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [n for item in node.elts for n in names_in(item)]
        return []

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            found += [(node.lineno, n) for side in (node.left, *node.comparators) for n in names_in(side)]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, n) for n in names_in(node.value)]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            found += [(node.lineno, n) for n in names_in(node)]
    return sorted(set(found))


def test_no_module_compares_an_objective_kind_name_outside_its_own():
    offences = []
    for layer in PACKAGE:
        for path in sorted((ROOT / layer).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where == REGISTRATION:
                continue
            for line, kind in kind_names_compared(path.read_text()):
                if where not in OWN_MODULES[kind]:
                    offences.append(f"{where}:{line} names objective.kind {kind!r}")
    assert not offences, "ask a capability (core.objective_kinds.ObjectiveCapabilities) instead:\n" + "\n".join(offences)


def test_every_registered_kind_has_its_own_modules_listed():
    assert set(OWN_MODULES) == KINDS
    assert all((ROOT / path).is_file() for paths in OWN_MODULES.values() for path in paths)


def test_the_scan_sees_each_form_of_comparison():
    source = (
        'if config.objective.kind == "grpo":\n    pass\n'
        'ok = name not in ("causal_lm", "sft")\n'
        'SUPPORTED = ["distill"]\n'
        'match kind:\n    case "dpo":\n        pass\n'
        'tasks = {"sft": 1}\n'  # a dict key is not a comparison
    )
    assert kind_names_compared(source) == [(1, "grpo"), (3, "causal_lm"), (3, "sft"), (4, "distill"), (6, "dpo")]
