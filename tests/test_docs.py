"""The docs stand alone: every document a file names is in the repository, and every link of a
markdown page leads to a file (and heading) that exists."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"datasets", "runs", "bench_out", "__pycache__", "node_modules"}
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".ini"}
TEXT_NAMES = {"Makefile", "run"}

# A document named in text: `docs/data.md`, `../docs/performance.md`, `contracts.md`.
MENTION = re.compile(r"(?<![\w./-])((?:\.\./)*\w[\w./-]*\.md)\b")
# A markdown link or image: [text](target) / ![alt](target).
LINK = re.compile(r"\]\(([^)\s]+)\)")


def repo_text_files() -> list[Path]:
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS]
        for name in names:
            path = Path(folder) / name
            if path.suffix in TEXT_SUFFIXES or name in TEXT_NAMES:
                files.append(path)
    return files


def anchor(heading: str) -> str:
    """The anchor a markdown renderer gives a heading: lower case, punctuation dropped, spaces
    to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), re.M)}


def test_every_named_document_is_in_the_repository():
    files = repo_text_files()
    markdown_names = {p.name for p in files if p.suffix == ".md"}
    missing = []
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for name in MENTION.findall(line):
                candidates = (path.parent / name, ROOT / name)
                if any(c.is_file() for c in candidates):
                    continue
                if "/" not in name and name in markdown_names:
                    continue
                missing.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert not missing, "documents named but not in the repository:\n" + "\n".join(missing)


def test_markdown_links_lead_somewhere():
    broken = []
    for page in (p for p in repo_text_files() if p.suffix == ".md"):
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path_part, _, fragment = target.partition("#")
            linked = (page.parent / path_part).resolve() if path_part else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


RECIPE_TABLE_HEADER = "| real-checkpoint recipe | tiny config | guarantee-table rows (`tests/configs/`) |"


def _trains(config) -> tuple:
    """What a recipe, its tiny config and its rows must share: the method, and LoRA or QLoRA."""
    return config.objective.kind, config.model.lora.rank > 0, config.model.quantize_base


def test_each_real_checkpoint_recipe_names_its_tiny_config_and_guarantee_rows():
    """docs/post_training.md's table "What `make test` runs of each recipe": every recipe config is
    a row; its tiny config trains as it does; its guarantee-table rows exist, run its method and
    read the tests/configs/ files the row names."""
    from core.config import load
    from tests.methods import BY_NAME

    guide = (ROOT / "docs" / "post_training.md").read_text().splitlines()
    start = guide.index(RECIPE_TABLE_HEADER) + 2
    rows = [line for line in guide[start:start + 20] if line.startswith("| `configs/")]
    recipes = sorted(p.stem for p in (ROOT / "configs").glob("qwen*.yaml")
                     if p.stem.endswith(("-sft", "-dpo", "-grpo", "-rm", "-ppo")))
    named = []
    for row in rows:
        recipe_cell, tiny_cell, rows_cell = (cell.strip() for cell in row.strip("|").split("|"))
        recipe, tiny = ROOT / recipe_cell.strip("`"), ROOT / tiny_cell.strip("`")
        named.append(recipe.stem)
        expected = _trains(load(recipe))
        assert _trains(load(tiny)) == expected, row
        names, _, files = rows_cell.partition("(")
        methods = [BY_NAME[name.strip(" `")] for name in names.split(",")]
        assert methods and all(load(m.config_path).objective.kind == expected[0] for m in methods), row
        assert _trains(load(methods[0].config_path)) == expected, row
        assert set(re.findall(r"`([\w.-]+\.yaml)`", files)) == {m.config for m in methods}, row
    assert sorted(named) == recipes
