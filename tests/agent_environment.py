"""An environment for the agent e2e runs (tests/configs/e2e-agent-grpo.yaml): an untrained tiny
model writes no tool calls, so this one answers every turn as if it were one, which makes every
episode several turns long.

A turn whose sampled token count is a multiple of 3, or the last turn, ends the episode; any
other is answered by the calculator with ``<count> * 7``. Each answer's reward is 1 when the turn's
text holds an odd number of lower-case letters, else 0, so a group's rewards vary. With the
environment variable ``LOCKSTEP_TEST_FORBID_TOOLS`` set, starting an episode fails: a replay,
which must not call the environment, runs with it set.

``CrashingCalculator`` raises on every turn: a method's ``prepare`` must stop with the runner's
typed error (``EnvironmentFailure``). ``recorded_hash`` is what a step's ``episodes_hash`` must
be, recomputed from the episodes the run recorded.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from data import calculator
from training.rollout.environment import Transition
from training.rollout.episode_store import read_episodes
from training.rollout.episodes import EpisodeResult, Turn

FORBID = "LOCKSTEP_TEST_FORBID_TOOLS"


class EveryTurnCalculator:
    tools = [calculator.SPEC]

    def reset(self, task, *, where):
        if os.environ.get(FORBID):
            raise AssertionError(f"the environment was called with {FORBID} set ({where})")
        return _Episode()


class _Episode:
    def step(self, turn, *, last=False):
        count = len(turn.sample.tokens)
        if last or count % 3 == 0:
            return Transition(reward=_parity(turn.text), done=True)
        return Transition(reward=_parity(turn.text), done=False, calls=(calculator.NAME,),
                          messages=({"role": "tool", "content": calculator.calculate(f"{count} * 7")},))


def _parity(text: str) -> float:
    return float(sum(c.islower() for c in text) % 2)


class CrashingCalculator:
    tools = [calculator.SPEC]

    def reset(self, task, *, where):
        return self

    def step(self, turn, *, last=False):
        raise RuntimeError("the calculator crashed")


def recorded_hash(run_dir: Path, step: int, group_size: int) -> str:
    """sha256 over the digests of step ``step``'s recorded episodes (runs/<id>/episodes), in global row order."""
    records = read_episodes(run_dir, step, group_size)
    rows = sorted(records, key=lambda key: key[0] * group_size + key[1])
    return hashlib.sha256(b"".join(bytes.fromhex(_digest(records[key])) for key in rows)).hexdigest()


def _digest(record: dict) -> str:
    turns = tuple(Turn(tuple(t["sampled"]), (), tuple(t["observation"])) for t in record["turns"])
    return EpisodeResult(turns, record["reward"]).digest
