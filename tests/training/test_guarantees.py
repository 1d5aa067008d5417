"""The guarantee table: every training method (tests/methods.py, one row each) keeps the four
guarantees end to end on 2 CPU ranks (tests/guarantees.py says exactly what each asserts):

- SIGKILL of the whole job at a random moment (the pretraining rows: of the resumed job again),
  then resume by run ID: the uninterrupted run's ledger, line for line and bit for bit;
- replay of a step before and after a checkpoint verifies;
- the 2-rank run's checkpoint resumed on 1 rank keeps the batches and the data position;
- micro-batch size 1 against 4 (accumulation): the same batches and loss.

Each row's uninterrupted run is trained once and read by its four checks and by the method's
own e2e file (the ``reference_runs`` fixture); a row's tests run on that file's worker.
"""

from __future__ import annotations

import pytest

from tests import guarantees
from tests.methods import METHODS

pytestmark = pytest.mark.slow

ROWS = [pytest.param(method, id=method.name) for method in METHODS]


@pytest.mark.parametrize("method", ROWS)
def test_sigkill_at_random_moments_then_resume_is_identical(reference_runs, method):
    guarantees.sigkill_then_resume_is_identical(reference_runs, method)


@pytest.mark.parametrize("method", ROWS)
def test_replay_verifies_before_and_after_a_checkpoint(reference_runs, method, tmp_path):
    guarantees.replay_verifies(reference_runs, method, tmp_path)


@pytest.mark.parametrize("method", ROWS)
def test_resume_on_one_rank_keeps_the_batches(reference_runs, method):
    guarantees.one_rank_resume_keeps_the_batches(reference_runs, method)


@pytest.mark.parametrize("method", ROWS)
def test_accumulation_does_not_change_the_step(reference_runs, method):
    guarantees.accumulation_changes_nothing(reference_runs, method)
