"""Write docs/config.md from the config dataclasses' field docstrings (core's and the registered objectives').

    python scripts/config_reference.py            # rewrite docs/config.md
    python scripts/config_reference.py --check    # exit 1 if docs/config.md is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.environment import require_dependencies  # noqa: E402

require_dependencies("scripts/config_reference.py")  # the system Python without .venv: one line

from core import config as config_lib  # noqa: E402

HEADER = """# Config reference

Generated from the field docstrings in `core/config.py` and in the objectives' settings modules
(`training/objectives/*_settings.py`, registered by `training/registry.py`) by
`python scripts/config_reference.py`.
Keys marked *resumable* may change on `--resume`; any other change is refused with a diff.
A list of sections has a row of its own and one per field of an item (`data.sources[i].path`:
the `path` of every item of `data.sources`); an optional section (`data.eval_source`) has its
fields' rows too, which apply when it is set.

| key | type | default | resumable | meaning |
|---|---|---|---|---|
"""


def render() -> str:
    rows = []
    for key, tp, default, doc in config_lib.describe():
        resumable = "yes" if config_lib.is_resumable(key) else ""
        rows.append(f"| `{key}` | {tp.replace('|', '/')} | `{default}` | {resumable} | {doc.replace('|', '/')} |")
    return HEADER + "\n".join(rows) + "\n"


def main() -> int:
    target = ROOT / "docs" / "config.md"
    text = render()
    if "--check" in sys.argv:
        return 0 if target.is_file() and target.read_text() == text else 1
    target.parent.mkdir(exist_ok=True)
    target.write_text(text)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
