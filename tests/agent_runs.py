"""What the agent e2e files (GRPO's and PPO's) check alike on a reference run of episodes."""

from __future__ import annotations

from pathlib import Path

from tests import launch
from tests.agent_environment import FORBID, recorded_hash


def checked_episode_lines(run_dir: Path, group_size: int) -> list[dict]:
    """The run's ledger lines, each checked: its step's episode record hashes to its
    ``episodes_hash``, the episodes called the tool over several turns without an environment
    error, its length statistics count sampled tokens only, and no two steps' episodes are alike."""
    lines = launch.ledger(run_dir)
    for line in lines:
        assert recorded_hash(run_dir, line["step"], group_size) == line["episodes_hash"], line["step"]
        assert line["turns_mean"] > 1.0 and line["tool_calls"] > 0 and line["env_errors"] == 0
        assert line["completion_len_mean"] <= 8 * 3  # sampled tokens only: max_new_tokens x max_turns
    assert len({line["episodes_hash"] for line in lines}) == len(lines)
    return lines


def replay_verifies_without_the_environment(reference_runs, run_dir: Path, timeout: float, monkeypatch) -> None:
    """``--replay`` of step 2 matches the ledger with an environment that fails if called."""
    monkeypatch.setenv(FORBID, "1")
    result = launch.train(reference_runs.workdir, ["--replay", run_dir.name, "--step", "2"], nproc=2,
                          timeout=timeout)
    assert result.returncode == 0, result.stderr
    assert "match" in result.stdout


def assert_trains_the_sampled_ids(batch, trajectories, handed: dict, *, purpose: str, group_size: int,
                                  zero_off_labels: tuple[str, ...]) -> None:
    """Each row's labels are exactly its episode's sampled ids, turn after turn (the scripted
    sampler's ``handed[(prompt, sample, turn)]``; sample 0 of a prompt plays two turns, the others
    one), each label is the next input id (so the trained inputs are the sampled ids), and the
    extras ``zero_off_labels`` are zero wherever there is no label."""
    import torch

    from data.batch import IGNORE_INDEX

    for i, t in enumerate(trajectories):
        prompt, sample = t.row // group_size, t.row % group_size
        turns = (purpose, f"{purpose}.turn1") if sample == 0 else (purpose,)
        labels = batch.labels[i]
        assert labels[labels != IGNORE_INDEX].tolist() == [token for turn in turns
                                                           for token in handed[(prompt, sample, turn)]]
        positions = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        assert torch.equal(batch.input_ids[i][positions + 1], labels[positions])
        for name in zero_off_labels:
            assert torch.count_nonzero(batch.extras[name][i][labels == IGNORE_INDEX]) == 0, name
