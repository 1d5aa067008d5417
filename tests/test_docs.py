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


# A run ID as the docs quote one, and a ledger line's sha256 (16 hex digits, maybe with "...").
RUN_ID = re.compile(r"`((?:[a-z0-9.]+-)+\d{8}-\d{6}-([0-9a-f]{8}))`")
LAST_LINE = re.compile(r"`([0-9a-f]{16})(?:\.\.\.)?`")


# Runs the docs quote beyond README.md's table: run ID -> (config, the command's overrides, the
# ledger's last-line sha256 prefix). docs/post_training.md's tiny DPO recipe and its start, its
# PPO and reward model, and its distillation's teacher and students.
FROM_TINY_SFT = ["parallel.device=cpu", "model.init_from=exports/tiny-sft"]
DISTILLED = ["parallel.device=cpu", "objective.distill.teacher=run:tiny-20261202-043217-112136ec"]
ALONE = ["parallel.device=cpu", "objective.kind=causal_lm", "run.name=tiny-student-alone"]
FROM_SHAPES = ["model.init_from=exports/tiny-vl-shapes"]
MEASURED = {
    "tiny-ppo-20261202-045750-ffedd2d1": ("tiny-ppo.yaml", FROM_TINY_SFT, "a025bdd97d909522"),
    "tiny-rm-20261202-045751-460a9237": ("tiny-rm.yaml", ["parallel.device=cpu"], "4216ccead1447f25"),
    "tiny-20261202-043217-112136ec": ("tiny.yaml", ["parallel.device=cpu", "train.max_steps=600"], "e2d9214447bc8609"),
    "tiny-distill-20261202-045238-d9e39891": ("tiny-distill.yaml", DISTILLED, "bf85104bad0bae39"),
    "tiny-student-alone-20261202-045328-e87b49d3": ("tiny-distill.yaml", ALONE, "cfa843dee78848e1"),
    "tiny-distill-20261202-045427-4983d156": ("tiny-distill.yaml", [*DISTILLED, "train.seed=1"], "d2b5550b013d6f0f"),
    "tiny-student-alone-20261202-045518-2dcb5396": ("tiny-distill.yaml", [*ALONE, "train.seed=1"], "0612af73eb742a9c"),
    "tiny-dpo-20261202-043218-b9a5bc66": ("tiny-dpo.yaml", FROM_TINY_SFT, "1a536e374278da07"),
    "tiny-dpo-20261202-044939-65472c01": ("tiny-dpo.yaml", [*FROM_TINY_SFT, "train.lr=0", "train.max_steps=1",
                                                            "train.eval_interval=1"], "59a2279806ba1125"),
    # README.md's vision-language chain: the shapes SFT stage and GRPO from its export on three seeds.
    "tiny-vl-shapes-sft-short-20261202-164959-39bc5641": ("tiny-vl-shapes-sft-short.yaml", [], "84d45db671bdcf17"),
    "tiny-vl-shapes-grpo-20261202-165018-aaf2b995": ("tiny-vl-shapes-grpo.yaml", [*FROM_SHAPES, "train.seed=1"],
                                                     "1bbe3ad265d51bb1"),
    "tiny-vl-shapes-grpo-20261202-165128-3d66041f": ("tiny-vl-shapes-grpo.yaml", [*FROM_SHAPES, "train.seed=2"],
                                                     "5ddec7577c2be652"),
    "tiny-vl-shapes-grpo-20261202-165236-bb971e76": ("tiny-vl-shapes-grpo.yaml", [*FROM_SHAPES, "train.seed=3"],
                                                     "2cf45b707f9fe72f"),
    "tiny-vl-shapes-grpo-20261202-165346-bf4bbbd5": ("tiny-vl-shapes-grpo.yaml", [
        *FROM_SHAPES, "train.seed=1", "train.lr=0", "train.max_steps=1", "train.eval_interval=1"], "d055440cca34c0c9"),
}


def _documented_runs() -> dict[str, tuple[str, list[str], str]]:
    """Run ID -> (config, the command's overrides, its ledger's last-line sha256 prefix): README.md's
    table of the tiny chain (tests/test_documented_runs.py re-derives its hashes) and MEASURED."""
    from tests.test_documented_runs import DOCUMENTED, README

    runs = dict(MEASURED)
    for label, config, overrides in DOCUMENTED:
        row = next(line for line in README.splitlines() if line.startswith(f"| {label} |"))
        runs[RUN_ID.search(row).group(1)] = (config, overrides, LAST_LINE.search(row).group(1))
    return runs


def _misquoted(text: str, runs: dict) -> list[str]:
    """The run IDs in ``text`` that are not in ``runs``, and the ledger hashes that differ from
    the last line's of the run quoted before them in their paragraph."""
    wrong = []
    for paragraph in text.split("\n\n"):
        quoted = sorted([(m.start(), "run", m.group(1)) for m in RUN_ID.finditer(paragraph)]
                        + [(m.start(), "hash", m.group(1)) for m in LAST_LINE.finditer(paragraph)])
        last_run = None
        for _, what, value in quoted:
            if what == "run":
                last_run = value
                if value not in runs:
                    wrong.append(f"{value} is not a run of README.md's table or MEASURED")
            elif last_run in runs and value != runs[last_run][2]:
                wrong.append(f"{value} follows {last_run}, whose last line is {runs[last_run][2]}")
    return wrong


def test_every_quoted_run_is_a_measured_command_with_its_ledger_hash():
    """A run ID quoted by a document or a config's header is a run of README.md's table or of
    MEASURED: its hash part is the config hash of its command, and a ledger hash quoted after it in its
    paragraph is that run's last line's. A number quoted with a run nobody can re-derive fails
    here until it is."""
    from core.config import load

    runs = _documented_runs()
    for run_id, (config, overrides, _) in runs.items():
        assert load(ROOT / "configs" / config, overrides).hash[:8] == run_id[-8:], run_id
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "configs").glob("*.yaml"))]
    wrong = [f"{page.relative_to(ROOT)}: {line}" for page in pages for line in _misquoted(page.read_text(), runs)]
    assert not wrong, "\n".join(wrong)
    run_id, (_, _, last) = next(iter(runs.items()))
    assert _misquoted(f"(`{run_id}`, last line `{last[::-1]}...`)", runs) != []  # the check can fail
    assert _misquoted("`tiny-20990101-000000-0123abcd`", runs) != []
