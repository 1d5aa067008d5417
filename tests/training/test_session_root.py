"""One run root, two spellings (training/session.py, ``root_override``): ``train.py --root DIR``, the
flag the tools take (``python -m experiments runs ... --root``, ``python -m training export|generate
--root``), is the override ``run.root=DIR`` (the config key) and reaches the same directory."""

from __future__ import annotations

import json

import pytest

from core import config as config_lib
from core.exceptions import UsageError
from experiments.__main__ import main as experiments_main
from tests import launch
from tests.e2e_config import e2e_args
from training import session

TINY = str(launch.ROOT / "configs" / "tiny.yaml")


def _config(*argv: str):
    args = session.parse_args(list(argv))
    return config_lib.load(args.config, args.overrides)


@pytest.mark.parametrize("root", ["elsewhere/runs", "1", "null"])  # a name YAML would read as a number or None
def test_the_flag_and_the_key_give_the_same_config(root, monkeypatch, tmp_path):
    monkeypatch.chdir(launch.ROOT)
    flag, key = _config("--config", TINY, "--root", root), _config("--config", TINY, f"run.root='{root}'")
    assert flag.run.root == key.run.root == root
    assert config_lib.config_hash(flag) == config_lib.config_hash(key)
    assert _config("--config", TINY, "--root", root, f"run.root='{root}'").run.root == root  # both, agreeing


def test_the_flag_and_the_key_naming_different_roots_is_a_usage_error():
    with pytest.raises(UsageError) as caught:
        session.parse_args(["--config", TINY, "--root", "a", "run.root=b"])
    assert caught.value.exit_code == 2 and "--root a and run.root=b" in str(caught.value)


def test_resume_finds_a_run_under_either_spelling(tmp_path):
    run_id = "tiny-20260101-000000-abcd1234"
    (tmp_path / run_id).mkdir()
    (tmp_path / run_id / "config.yaml").write_text("run: {name: tiny}\n")
    for spelling in (["--root", str(tmp_path)], [f"run.root={tmp_path}"]):
        assert session.parse_args(["--resume", "tiny-2026", *spelling]).resume == run_id  # a unique prefix


@pytest.mark.slow
def test_runs_started_with_either_spelling_are_where_the_tools_look(e2e_workdir, tmp_path, capsys):
    root = tmp_path / "elsewhere"
    flag, key = launch.train_in_turn(e2e_workdir, [
        e2e_args(max_steps=1, name="root-flag", overrides=["--root", str(root), "parallel.strategy=none"]),
        e2e_args(max_steps=1, name="root-key", overrides=[f"run.root={root}", "parallel.strategy=none"]),
    ])
    assert flag.returncode == 0 and key.returncode == 0, flag.stderr + key.stderr
    assert flag.run_dir.parent == key.run_dir.parent == root
    capsys.readouterr()
    assert experiments_main(["runs", "list", "--root", str(root), "--json"]) == 0
    listed = {run["run_id"] for run in json.loads(capsys.readouterr().out)}
    assert listed == {flag.run_id, key.run_id}
