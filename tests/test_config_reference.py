"""docs/config.md against the config schema: one row per key, every list item's and optional
section's fields included, each with the default a freshly built config really has."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from core import config as config_lib

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def _rows() -> dict[str, dict[str, str]]:
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) == 5 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = {"type": cells[1], "default": cells[2].strip("`"), "meaning": cells[4]}
    return rows


def _schema(instance, prefix: str = "") -> dict[str, object]:
    """Every key of the schema -> the value a default-built ``instance`` holds there; the
    fields of a list's items and of an optional section from a default-built item."""
    out: dict[str, object] = {}
    hints = typing.get_type_hints(type(instance))
    for field in dataclasses.fields(instance):
        value, tp = getattr(instance, field.name), hints[field.name]
        if dataclasses.is_dataclass(tp):
            out.update(_schema(value, f"{prefix}{field.name}."))
            continue
        out[f"{prefix}{field.name}"] = value
        sections = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if sections:
            index = "[i]" if typing.get_origin(tp) is tuple else ""
            out.update(_schema(sections[0](), f"{prefix}{field.name}{index}."))
    return out


def test_every_key_of_the_schema_has_one_row_with_its_real_default():
    rows, schema = _rows(), _schema(config_lib.Config())
    assert sorted(rows) == sorted(schema), {"undocumented": sorted(set(schema) - set(rows)),
                                           "not in the schema": sorted(set(rows) - set(schema))}
    wrong = {key: (rows[key]["default"], repr(config_lib.to_dict(value))) for key, value in schema.items()
             if rows[key]["default"] != repr(config_lib.to_dict(value))}
    assert not wrong, wrong
    assert {"data.sources[i].path", "data.sources[i].record", "objective.grpo.rewards[i].name",
            "data.eval_source.path"} <= set(rows)


def test_every_objective_kind_is_named_where_objective_kind_is_explained():
    kinds = typing.get_args(typing.get_type_hints(config_lib.objective_config_class())["kind"])
    meaning = _rows()["objective.kind"]["meaning"]
    assert [kind for kind in kinds if kind not in meaning] == []

