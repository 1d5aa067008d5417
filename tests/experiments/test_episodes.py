"""experiments/episodes.py and ``python -m experiments runs episodes RUN_ID --step S``: a step's
episodes as text (rows, turns, tools, observations, rewards), and the typed refusals naming the
file (a run without an environment: exit 2; a step without its file: exit 2; a damaged file: 3)."""

from __future__ import annotations

import dataclasses

import pytest

from core.config import Config, save
from data.tokenizers import build_tokenizer
from experiments.__main__ import main
from experiments.episodes import StepEpisodes, format_episodes
from training.rollout.environment_settings import EnvironmentSettings
from training.rollout.episode_store import episodes_path, write_episodes

RUN = "agent-20260101-000000-0123abcd"
CALL = '<tool_call>{"name": "calculator"}</tool_call>'
ANSWER = "<tool_response>36</tool_response>"


def _encode(text: str) -> list[int]:
    return [int(t) for t in build_tokenizer("byte").encode_array(text)]


def _records() -> dict[int, dict]:
    """Row 0 (prompt row 0, sample 0): a calculator call answered, then the answer; row 1: a malformed
    call, then a truncated answer scored 0."""
    call = {"sampled": _encode(CALL),
            "observation": _encode(ANSWER), "calls": ["calculator"],
            "outcome": "continue", "malformed": 0}
    return {
        0: {"turns": [call, {"sampled": _encode("36"), "observation": [], "calls": [], "outcome": "done",
                             "malformed": 0}],
            "reward": 1.0, "reward_errors": 0, "env_errors": 0, "truncated": False},
        1: {"turns": [{"sampled": _encode("<tool_call>{oops"), "observation": [], "calls": [""], "outcome": "done",
                       "malformed": 1}],
            "reward": 0.0, "reward_errors": 0, "env_errors": 1, "truncated": True},
    }


def _run(root, *, environment=True, steps=(3,)):
    run = root / RUN
    run.mkdir(parents=True)
    config = Config()
    grpo = dataclasses.replace(config.objective.grpo, group_size=2,
                               environment=EnvironmentSettings(name="calculator") if environment else None)
    config = dataclasses.replace(config, objective=dataclasses.replace(config.objective, kind="grpo", grpo=grpo))
    save(config, run / "config.yaml")
    for step in steps if environment else ():
        write_episodes(run, step, _records())
    return run


def test_a_steps_episodes_print_as_text_by_a_unique_prefix(tmp_path, capsys):
    run = _run(tmp_path)
    assert main(["runs", "episodes", "agent-2026", "--step", "3", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run {RUN} step 3: 2 episodes, group_size 2 ({episodes_path(run, 3)})\n")
    assert ("episode row 0: prompt row 0, sample 0 | reward 1.0000 | 2 turns | 1 tool call, 0 malformed\n"
            "  turn 0 (continue), calls: calculator\n"
            f"    sampled ({len(CALL)} ids):\n"  # the byte tokenizer: one id per byte
            f"      {CALL}\n"
            f"    observation ({len(ANSWER)} ids):\n"
            f"      {ANSWER}\n"
            "  turn 1 (done)\n"
            "    sampled (2 ids):\n"
            "      36\n") in out
    assert ("episode row 1: prompt row 0, sample 1 | reward 0.0000 | 1 turn | 1 tool call, 1 malformed | truncated "
            "| env_errors 1\n  turn 0 (done), calls: (malformed)\n") in out
    assert main(["runs", "episodes", RUN, "--step", "3", "--ids", "--root", str(tmp_path)]) == 0
    assert "      51 54\n" in capsys.readouterr().out  # "36" as ids


def test_a_run_without_an_environment_or_a_step_without_its_file_is_a_usage_error_naming_it(tmp_path, capsys):
    plain = _run(tmp_path / "plain", environment=False)
    assert main(["runs", "episodes", RUN, "--step", "1", "--root", str(tmp_path / "plain")]) == 2
    err = capsys.readouterr().err
    assert f"is not an agent run: {plain / 'config.yaml'} sets no objective.grpo.environment" in err
    agent = _run(tmp_path / "agent", steps=(1, 2, 3, 5))
    assert main(["runs", "episodes", RUN, "--step", "4", "--root", str(tmp_path / "agent")]) == 2
    err = capsys.readouterr().err
    assert f"step 4 of run {RUN} has no episodes file {episodes_path(agent, 4)}" in err
    assert "it records steps 1-3, 5; pick one with --step" in err


def test_a_damaged_episodes_file_is_a_data_error_naming_it(tmp_path, capsys):
    run = _run(tmp_path)
    episodes_path(run, 3).write_text('{"version": 1, "step": 3, "rows": {"0": ')
    assert main(["runs", "episodes", RUN, "--step", "3", "--root", str(tmp_path)]) == 3
    assert f"the episodes file {episodes_path(run, 3)} is unreadable" in capsys.readouterr().err
    with pytest.raises(Exception) as error:
        StepEpisodes.read(run, 3)
    assert error.value.exit_code == 3


def test_the_text_decodes_with_the_function_given():
    episodes = StepEpisodes(run_id="r", step=1, path=None, group_size=1, tokenizer="byte", rows=_records())
    text = format_episodes(episodes, lambda ids: f"<{len(ids)} ids>")
    assert "episode row 1: prompt row 1, sample 0" in text and "      <2 ids>" in text
