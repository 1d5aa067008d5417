"""The ``slow`` marks of tests/conftest.py stay true to the files they name: every test or
fixture the table lists exists, so a rename cannot silently move a multi-process test into
``make test-fast``."""

from __future__ import annotations

import ast

import pytest

from tests import conftest


@pytest.mark.parametrize("path", sorted(conftest.STARTS_PROCESSES))
def test_every_listed_test_or_fixture_exists(path):
    tree = ast.parse((conftest.ROOT / "tests" / path).read_text())
    defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    missing = conftest.STARTS_PROCESSES[path] - defined
    assert not missing, f"tests/{path} defines no {sorted(missing)}: update STARTS_PROCESSES"


class FakeItem:
    def __init__(self, path: str, name: str, fixtures: tuple[str, ...] = ()) -> None:
        self.path = conftest.ROOT / "tests" / path
        self.originalname = name
        self.name = f"{name}[param]"
        self.fixturenames = list(fixtures)


@pytest.mark.parametrize(
    "item, slow",
    [
        (FakeItem("distributed/test_parallelize.py", "test_x", ("ranks", "single")), True),
        (FakeItem("distributed/test_parallelize.py", "test_clipping_was_active", ("single",)), False),
        (FakeItem("test_train_cli.py", "test_usage_errors_exit_2", ("tmp_path",)), True),
        (FakeItem("test_train_cli.py", "test_config_errors_exit_2_in_process", ("tmp_path",)), False),
        (FakeItem("data/test_new.py", "test_anything", ("e2e_workdir",)), True),
        (FakeItem("data/test_new.py", "test_anything", ("tmp_path",)), False),
    ],
)
def test_a_test_starts_processes_by_name_or_by_fixture(item, slow):
    assert conftest.starts_processes(item) is slow
