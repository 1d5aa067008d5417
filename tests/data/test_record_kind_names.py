"""No code outside a record kind's own row asks which record kind a source has by name.

What a stage, a packer or an objective's checks need to know about a source's records is what
its row declares (data/record_kinds.py: its columns, encoder, template, one record a row, the
document fields it carries), never its name. A comparison with a registered record kind's name
(``record == "prompt"``, ``kind != "text"``, ``record in ("chat", "preference")``, ``case "chat":``)
is read with ``ast`` in every module of core/, data/ and training/; only the kind's own module may
hold one (core asks what a row declared when it registered its name: core/record_kinds.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

from data.record_kinds import BUILT_IN, record_kinds

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("core", "data", "training")
OWN_MODULES = {path.split(":")[0].replace(".", "/") + ".py" for path in BUILT_IN} | {"data/record_kinds.py"}


def kind_names_compared(source: str, kinds: set[str]) -> list[tuple[int, str]]:
    """(line, kind) for every record kind name compared or matched in ``source``."""

    def names_in(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and node.value in kinds:
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [n for item in node.elts for n in names_in(item)]
        return []

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            found += [(node.lineno, n) for side in (node.left, *node.comparators) for n in names_in(side)]
        elif isinstance(node, ast.MatchValue):
            found += [(node.lineno, n) for n in names_in(node.value)]
    return sorted(set(found))


def test_no_module_compares_a_record_kind_name_outside_its_row():
    kinds = set(record_kinds())
    offences = []
    for layer in SCANNED:
        for path in sorted((ROOT / layer).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where in OWN_MODULES:
                continue
            offences += [f"{where}:{line} compares record kind {kind!r}"
                         for line, kind in kind_names_compared(path.read_text(), kinds)]
    assert not offences, "ask what the row declares (data/record_kinds.py) instead:\n" + "\n".join(offences)


def test_every_built_in_row_sits_in_its_listed_module():
    assert all((ROOT / path).is_file() for path in OWN_MODULES)
    assert {"text", "chat", "prompt_completion", "prompt", "preference"} <= set(record_kinds())


def test_the_scan_sees_each_form_of_comparison():
    source = (
        'if source.record == "prompt":\n    pass\n'
        'ok = kind not in ("chat", "text")\n'
        'match record:\n    case "preference":\n        pass\n'
        'columns = {"chat": ("messages",)}\n'  # a dict key is not a comparison
        'role = message["role"] == "user"\n'  # not a record kind
    )
    kinds = {"text", "chat", "prompt", "preference"}
    assert kind_names_compared(source, kinds) == [(1, "prompt"), (3, "chat"), (3, "text"), (5, "preference")]
