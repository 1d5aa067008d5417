"""train.py with the test-only model family ``gelu_lm`` (tests/families/gelu_lm.py) registered: the
``entry`` of the guarantee table's ``gelu-lm`` row (tests/methods.py), so the family exists in the
spawned ranks, their resumes and replays, and nowhere else."""

from __future__ import annotations

import train  # noqa: E402  (train.py: sets up the process as it does when run itself)
from runtime.fast_exit import exit_process
from tests.families import gelu_lm
from training.registry import register_all

if __name__ == "__main__":
    register_all()  # the built-in rows first: model.arch's listing and LoRA's default targets stay Qwen's
    gelu_lm.register()
    exit_process(train.main())
