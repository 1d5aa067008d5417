"""train.py with PPO's objective replaced by one that SIGKILLs its whole job (every rank and the
launcher: the process group ``launch.start`` made) when an update of one step begins: the
kill lands in the middle of the PPO epochs over that step's rollout batch, between two
optimizer updates, where a random kill may or may not land. ``KILL_AT`` (``STEP:UPDATE``) says
where; the job is killed once (a marker file next to the run dirs), so a resume through this
script runs on. tests/training/test_ppo_e2e.py starts its ranks with it (``launch.start(..., entry=...)``)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import train  # noqa: E402  (train.py: sets up the process as it does when run itself)
from runtime.fast_exit import exit_process
from training.objectives.ppo import PPOObjective
from training.registry import register_all

KILL_AT = "LOCKSTEP_TEST_PPO_KILL_AT"
MARKER = Path("ppo-killed-once")  # in the job's working directory


class KilledPPOObjective(PPOObjective):
    def update_batch(self, batch, update: int):
        if os.environ.get(KILL_AT) == f"{batch.step}:{update}" and not MARKER.exists():
            MARKER.write_text(f"killed at step {batch.step}, update {update}\n")
            os.killpg(os.getpgrp(), signal.SIGKILL)
        return super().update_batch(batch, update)


if __name__ == "__main__":
    register_all(objectives={PPOObjective.name: "tests.training.ppo_kill_train:KilledPPOObjective"})
    exit_process(train.main())
