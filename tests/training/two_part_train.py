"""train.py with the two-part test objective (two_part_objective.py) as ``objective.kind:
causal_lm``: the entry point tests/training/test_two_part_e2e.py starts its ranks with
(``launch.ENTRY_ENV``), so the objective exists in the spawned processes without a config key
of its own."""

from __future__ import annotations

import train  # noqa: E402  (train.py: sets up the process as it does when run itself)
from runtime.fast_exit import exit_process
from tests.training.two_part_objective import TwoPartObjective
from training import objectives

if __name__ == "__main__":
    objectives.OBJECTIVES["causal_lm"] = TwoPartObjective
    exit_process(train.main())
