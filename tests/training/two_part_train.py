"""train.py with the two-part test objective (two_part_objective.py) registered as
``objective.kind: two_part``: the ``entry`` of the guarantee table's ``two-part`` row
(tests/methods.py), so the kind exists in the spawned processes (train, resume, replay) and
nowhere else."""

from __future__ import annotations

import train  # noqa: E402  (train.py: sets up the process as it does when run itself)
from core.objective_kinds import ObjectiveKind, register_objective
from runtime.fast_exit import exit_process
from tests.training.two_part_objective import TwoPartObjective
from training.registry import register_all

if __name__ == "__main__":
    register_all()  # the built-in kinds first: the first registered is objective.kind's default
    register_objective(ObjectiveKind(name=TwoPartObjective.name, summary="test objective: the policy plus a value model",
                                     objective="tests.training.two_part_objective:TwoPartObjective"))
    exit_process(train.main())
