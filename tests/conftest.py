"""Test setup: the repository root is importable (its folders are not installed packages)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import os  # noqa: E402
import subprocess  # noqa: E402

import torch  # noqa: E402

if not torch.cuda.is_available():
    # torchao (imported by the NF4 and FP8 tests, and by peft) only ships CUDA kernels as
    # native libraries; their failed loads preceded rare heap-corruption crashes of spawned
    # ranks here. Children inherit the variable. models/nf4.py does the same for users.
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def e2e_workdir(tmp_path_factory):
    """A working directory holding the prepared stdlib shards, shared by end-to-end tests."""
    workdir = tmp_path_factory.mktemp("e2e")
    subprocess.run(
        [sys.executable, "-m", "data", "prepare", "--out", str(workdir / "datasets" / "stdlib")],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return workdir


def pytest_collection_modifyitems(config, items):
    """Files with more multi-process tests (marked ``slow``) run earlier. Spread over pytest-xdist
    workers (``make test``: whole files per worker, in this order), the long files start first
    and the short in-process ones fill the workers in at the end, instead of one worker
    finishing a long file alone. The sort is stable: a file's tests keep their order."""
    slow: dict = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])
