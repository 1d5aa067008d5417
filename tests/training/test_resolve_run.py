"""``python -m training export --run`` / ``generate --from`` / ``score --from`` find a run as
``--resume`` does (training/checkpoint/load.py ``resolve_run``): a run directory, a run ID under
``--root``, or a unique prefix of one; a prefix of several runs or none is a usage error (exit 2)
naming what it matched."""

from __future__ import annotations

import pytest

from core.exceptions import ExitCode, UsageError
from training.checkpoint.load import resolve_run


def _runs(root, *names):
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "config.yaml").write_text("{}\n")


def test_a_unique_prefix_names_its_run(tmp_path):
    _runs(tmp_path, "sft-20261201-100000-aaaaaaaa", "rm-20261201-100000-bbbbbbbb")
    assert resolve_run("sft-2026", str(tmp_path)).root.name == "sft-20261201-100000-aaaaaaaa"
    assert resolve_run("rm-20261201-100000-bbbbbbbb", str(tmp_path)).root.name == "rm-20261201-100000-bbbbbbbb"
    assert resolve_run(str(tmp_path / "rm-20261201-100000-bbbbbbbb"), "elsewhere").root.name.startswith("rm-")


@pytest.mark.parametrize("prefix, message", [("sft-2026120", "matches 2 runs"), ("ppo", "no run 'ppo'")])
def test_an_ambiguous_or_unknown_prefix_is_a_usage_error_naming_the_matches(tmp_path, prefix, message):
    _runs(tmp_path, "sft-20261201-100000-aaaaaaaa", "sft-20261202-100000-cccccccc")
    with pytest.raises(UsageError) as error:
        resolve_run(prefix, str(tmp_path))
    assert message in error.value.message and error.value.exit_code == ExitCode.CONFIG
    if "matches" in message:
        assert "sft-20261201-100000-aaaaaaaa" in error.value.message and "sft-20261202-100000-cccccccc" in error.value.message
