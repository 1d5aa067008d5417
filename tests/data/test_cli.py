"""``python -m data prepare | inspect | bench`` (run in-process through data.__main__.main)."""

from __future__ import annotations

import json

import yaml

from core.config import SourceConfig, load
from data.__main__ import main
from data.hashing import state_hash
from data.pipeline import build
from data.sources import Source
from tests.data.corpus import global_hashes, write_parquet, write_zst


def _config_file(tmp_path, sources, **data) -> str:
    cfg = {
        "train": {"seed": 3, "global_batch_size": 8, "micro_batch_size": 2},
        "data": {"sources": sources, "seq_len": 40, "num_streams": 4, "workers": 1,
                 "process_pool": False, **data},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_prepare_stdlib_writes_both_formats_and_is_idempotent(tmp_path, capsys):
    out = tmp_path / "stdlib"
    assert main(["prepare", "--out", str(out)]) == 0
    first = capsys.readouterr().out
    assert first.startswith(f"wrote: {out}") and "data:" in first
    assert (out / ".complete").is_file()
    assert {".zst", ".parquet"} <= {p.suffix for p in (out / "train").iterdir()}
    for pattern in ("train/*.jsonl.zst", "train/*.parquet", "eval/*.jsonl.zst"):
        source = Source(SourceConfig(path=str(out / pattern)), label="s")
        assert len(source.units()) >= 8  # every one of 8 streams gets a frame or row group
    mtime = (out / "manifest.json").stat().st_mtime_ns
    assert main(["prepare", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"up to date: {out}")
    assert (out / "manifest.json").stat().st_mtime_ns == mtime


def test_prepare_reshards_a_users_files_into_indexed_zst(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(30):
        (docs / f"f{i:02d}.txt").write_text(f"text file {i}\n" * (i + 1))
    out = tmp_path / "out"
    assert main(["prepare", "--input", str(docs), "--input-format", "text", "--out", str(out),
                 "--frame-docs", "4", "--eval-every", "0"]) == 0
    source = Source(SourceConfig(path=str(out / "train")), label="s")
    texts = sorted(json.loads(r.payload)["text"] for u in source.units() for r in source.read(u, 0, None))
    assert texts == sorted(f"text file {i}\n" * (i + 1) for i in range(30))
    assert all(u.num_records <= 4 for u in source.units())


def test_inspect_reports_the_batch_hash_the_trainer_computes(tmp_path, capsys):
    write_zst(tmp_path / "z", shards=2, docs=20)
    write_parquet(tmp_path / "p", shards=1, docs=20)
    config_path = _config_file(tmp_path, [{"path": str(tmp_path / "z"), "weight": 2.0},
                                          {"path": str(tmp_path / "p"), "text_column": "body"}])
    assert main(["inspect", "--config", config_path, "--step", "4", "--json", "data.seq_len=48"]) == 0
    report = json.loads(capsys.readouterr().out)
    config = load(config_path, ["data.seq_len=48"])
    ranks = []
    for r in range(2):  # what two ranks of a trainer would gather
        with build(config.data, seed=3, global_batch_size=8, rank=r, world_size=2) as pipe:
            ranks.append([next(pipe) for _ in range(4)])
    assert report["step"] == 4 and report["batch_hash"] == global_hashes(ranks)[3]
    merged = {"version": 1, "streams": {**ranks[0][3].state["streams"], **ranks[1][3].state["streams"]}}
    assert report["data_state_hash"] == state_hash(merged)
    assert len(report["sequences"]) == 8 and all(len(row["digest"]) == 64 for row in report["sequences"])
    assert report["sequences"][0]["provenance"][0]["shard"].startswith(str(tmp_path))
    assert main(["inspect", "--config", config_path, "--step", "2"]) == 0
    assert "batch_hash" in capsys.readouterr().out


def test_bad_data_path_exits_3_with_one_line(tmp_path, capsys):
    config_path = _config_file(tmp_path, [{"path": str(tmp_path / "missing")}])
    assert main(["inspect", "--config", config_path, "--step", "1"]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith("data error:") and "missing" in err and "\n" not in err


def test_bench_prints_a_table_and_writes_json(tmp_path, capsys):
    write_zst(tmp_path / "z", shards=2, docs=20)
    config_path = _config_file(tmp_path, [{"path": str(tmp_path / "z")}])
    out = tmp_path / "bench.json"
    assert main(["bench", "--config", config_path, "--batches", "6", "--workers", "0,2", "--repeat", "1", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "tokens/s" in table and "busy s" in table
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == ["bare", "naive", "pipeline", "pipeline"]
    assert all(r["tokens_per_s"] > 0 for r in report["rows"])


def test_inspect_from_a_run_starts_at_its_checkpoint_and_agrees(tmp_path, capsys):
    import pytest

    from core.exceptions import UsageError
    from data.inspection import global_batch

    write_zst(tmp_path / "z", shards=2, docs=20)
    config_path = _config_file(tmp_path, [{"path": str(tmp_path / "z")}])
    config = load(config_path, [])
    with build(config.data, seed=3, global_batch_size=8, rank=0, world_size=1) as pipe:
        states = {b.step: b.state for b in (next(pipe) for _ in range(7))}
    run = tmp_path / "run"
    for step in (3, 7):  # 7 is after the inspected step: never used for it
        (run / "checkpoints" / f"step_{step:08d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{step:08d}" / "data_state.json").write_text(json.dumps(states[step]))
    (run / "checkpoints" / ".tmp-step_00000005-abcd").mkdir()  # unpublished: ignored
    assert main(["inspect", "--config", config_path, "--step", "6", "--json"]) == 0
    walked = json.loads(capsys.readouterr().out)
    assert main(["inspect", "--config", config_path, "--step", "6", "--json", "--run", str(run)]) == 0
    out = capsys.readouterr()
    assert "after checkpoint step 3" in out.err
    assert json.loads(out.out) == walked
    with pytest.raises(UsageError, match="after batch 7, not before batch 6"):
        global_batch(config, 6, start_state=states[7])
    assert main(["inspect", "--config", config_path, "--step", "2", "--run", str(run)]) == 0
    assert "walking from batch 1" in capsys.readouterr().err
    assert main(["inspect", "--config", config_path, "--step", "2", "--run", str(tmp_path / "nope")]) == 2


def test_inspect_shows_which_tokens_of_each_conversation_are_trained(tmp_path, capsys):
    from data.tasks import write_task_datasets

    write_task_datasets(tmp_path / "tasks", seed=0, train_n=64, eval_n=0)
    config_path = tmp_path / "chat.yaml"
    config_path.write_text(yaml.safe_dump({
        "data": {"sources": [{"path": str(tmp_path / "tasks" / "sft" / "train.jsonl"), "record": "chat"}],
                 "seq_len": 256, "num_streams": 2},
        "train": {"global_batch_size": 2},
    }))
    assert main(["inspect", "--config", str(config_path), "--step", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    records = [json.loads(line) for line in (tmp_path / "tasks" / "sft" / "train.jsonl").read_text().splitlines()]
    for row in report["sequences"]:
        for span in row["provenance"]:
            if span["source"] == "<padding>":
                assert span["trained_tokens"] == 0
                continue
            answers = [m["content"] for m in records[span["record"]]["messages"] if m["role"] == "assistant"]
            # Only the assistant turns (each with its end-of-turn marker) are trained.
            assert span["trained_text"] == " | ".join(a + "<|im_end|>" for a in answers)
    assert main(["inspect", "--config", str(config_path), "--step", "1"]) == 0
    assert "trained:" in capsys.readouterr().out


def test_inspect_shows_tool_calls_trained_and_tool_results_not(tmp_path, capsys):
    from data.agent_tasks import write_agent_datasets

    write_agent_datasets(tmp_path / "agent", seed=0, train_n=16, eval_n=0)
    source = tmp_path / "agent" / "sft" / "train.jsonl"
    config_path = tmp_path / "agent.yaml"
    config_path.write_text(yaml.safe_dump({
        "data": {"sources": [{"path": str(source), "record": "chat"}], "seq_len": 896, "num_streams": 2},
        "train": {"global_batch_size": 2},
    }))
    assert main(["inspect", "--config", str(config_path), "--step", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    records = [json.loads(line) for line in source.read_text().splitlines()]
    spans = [s for row in report["sequences"] for s in row["provenance"] if s["source"] != "<padding>"]
    assert spans
    for span in spans:
        user, call, result, answer = records[span["record"]]["messages"]
        expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
        # The call (with its end-of-turn marker) and the answer are trained; the tool's result is not.
        assert span["trained_text"] == (
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'
            "<|im_end|> | " + answer["content"] + "<|im_end|>")
        assert result["content"] == answer["content"]
        assert span["trained_tokens"] == len(span["trained_text"]) - len(" | ")  # one byte per token
    assert main(["inspect", "--config", str(config_path), "--step", "1"]) == 0
    assert "trained: '<tool_call>" in capsys.readouterr().out
