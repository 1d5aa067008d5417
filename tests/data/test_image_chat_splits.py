"""The embedded image splits' files (data/vision/chat_data.py write_parts, write_splits): a split of at
least PARTS records is PARTS files, a smaller one a file a record, no file is empty, and every record
the spec draws is written once, in order; a split of no records is refused; splits stamped under the
old layout (every split PARTS files, empty ones among them) are written again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.exceptions import DataError
from data.vision.chat_data import CHAT_SPEC, LAYOUT, PARTS, conversations, parts_of, read_parts, write_chat, write_parts
from data.vision.prompt_data import PROMPTS_SPEC, image_prompts, write_prompts
from data.vision.shapes import SHAPES_SPEC, generate, write_shapes


def _files(directory: Path) -> list[Path]:
    return sorted(directory.glob("part-*.jsonl"))


@pytest.mark.parametrize("count", [1, 7, 8, 15, 16, 17, 96])
def test_a_split_is_at_most_parts_files_none_empty_each_record_once(tmp_path, count):
    records = [{"n": i, "text": f"record {i}"} for i in range(count)]
    write_parts(tmp_path / "split", records)
    files = _files(tmp_path / "split")
    assert [f.name for f in files] == [f"part-{i:03d}.jsonl" for i in range(min(PARTS, count))]
    sizes = [len(f.read_text().splitlines()) for f in files]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1  # none empty, spread as evenly as the count allows
    assert read_parts(tmp_path / "split") == records


def test_a_split_of_no_records_is_refused(tmp_path):
    with pytest.raises(DataError, match="a split of no records") as error:
        write_parts(tmp_path / "eval", [])
    assert error.value.context["path"] == str(tmp_path / "eval") and "eval_n" in error.value.hint
    assert not (tmp_path / "eval").exists()


def _expected_splits() -> dict[str, list[dict]]:
    """Every embedded split's directory (relative to datasets/images) and the records its spec draws."""
    chats = conversations(CHAT_SPEC["train_n"] + CHAT_SPEC["eval_n"], CHAT_SPEC["seed"], CHAT_SPEC["photographs"])
    prompts = image_prompts(PROMPTS_SPEC["train_n"] + PROMPTS_SPEC["eval_n"], PROMPTS_SPEC["seed"],
                            PROMPTS_SPEC["photographs"])
    shapes = generate(SHAPES_SPEC)
    return {"chat/train": chats[:CHAT_SPEC["train_n"]], "chat/eval": chats[CHAT_SPEC["train_n"]:],
            "prompts/train": prompts[:PROMPTS_SPEC["train_n"]], "prompts/eval": prompts[PROMPTS_SPEC["train_n"]:],
            **{f"shapes/{kind}/{split}": shapes[kind][split] for kind in ("chat", "prompts") for split in ("train", "eval")}}


def test_every_embedded_split_is_non_empty_files_holding_each_record_once(tmp_path):
    write_chat(tmp_path / "chat")
    write_prompts(tmp_path / "prompts")
    write_shapes(tmp_path / "shapes")
    expected = _expected_splits()
    written = {str(d.relative_to(tmp_path)) for d in tmp_path.rglob("*") if d.is_dir() and _files(d)}
    assert written == set(expected)  # no split left out of this check
    for split, records in expected.items():
        files = _files(tmp_path / split)
        assert len(files) == parts_of(len(records)) >= min(8, len(records)), split  # a unit for each of 8 streams
        assert all(f.stat().st_size > 0 for f in files), split
        assert read_parts(tmp_path / split) == records, split
    assert len(_files(tmp_path / "chat" / "eval")) == CHAT_SPEC["eval_n"] == 8  # one held-out chat a file


def test_splits_written_under_the_old_layout_are_written_again(tmp_path):
    out = tmp_path / "chat"
    assert write_chat(out) and not write_chat(out)
    stamp = json.loads((out / ".complete").read_text())
    assert stamp["layout"] == LAYOUT
    for i in range(CHAT_SPEC["eval_n"], PARTS):  # as the old writer left them: 16 files, the last 8 empty
        (out / "eval" / f"part-{i:03d}.jsonl").write_text("")
    (out / ".complete").write_text(json.dumps({**CHAT_SPEC, "parts": PARTS}))
    assert write_chat(out)
    assert all(f.stat().st_size > 0 for f in _files(out / "eval")) and len(_files(out / "eval")) == CHAT_SPEC["eval_n"]
