"""What a new user's mistakes print: one line that names the mistake and the way out."""

from __future__ import annotations


import pytest

from core import config as config_lib
from core.exceptions import ConfigError


def _generate(capsys, tmp_path, *args: str) -> tuple[int, str]:
    from training.__main__ import main

    code = main(["generate", "--prompt", "hi", "--root", str(tmp_path / "runs"), *args])
    return code, capsys.readouterr().err


def test_generate_from_a_missing_directory_says_it_does_not_exist(capsys, tmp_path):
    code, err = _generate(capsys, tmp_path, "--from", str(tmp_path / "exports" / "nope"))
    assert code == 2 and "exports/nope does not exist" in err and "resume" not in err, err
    (tmp_path / "empty").mkdir()
    code, err = _generate(capsys, tmp_path, "--from", str(tmp_path / "empty"))
    assert code == 2 and "is not a run directory" in err, err


def test_generate_from_an_unknown_run_is_not_a_resume_error(capsys, tmp_path):
    root = tmp_path / "runs"
    for run_id in ("old-20260101-000000-aaaaaaaa", "new-20260102-000000-bbbbbbbb"):
        (root / run_id).mkdir(parents=True)
        config_lib.save(config_lib.Config(), root / run_id / "config.yaml")
    code, err = _generate(capsys, tmp_path, "--from", "no-such-run")
    assert code == 2, err
    assert err.startswith("usage error: no run 'no-such-run'") and "resume" not in err, err
    assert "newest first: new-20260102-000000-bbbbbbbb, old-20260101-000000-aaaaaaaa" in err, err


@pytest.mark.parametrize("loss", ["orpo", "simpo", "ipo"])
def test_a_preference_loss_given_as_the_objective_kind_points_to_objective_dpo_loss(loss):
    with pytest.raises(ConfigError) as info:
        config_lib.load(None, [f"objective.kind={loss}"])
    assert f"objective.kind=dpo objective.dpo.loss={loss}" in str(info.value)
    assert "grpo" not in str(info.value).split("->")[1]
