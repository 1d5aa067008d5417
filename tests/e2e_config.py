"""The small config end-to-end tests train (a shrunk tiny.yaml on the prepared stdlib shards)."""

from __future__ import annotations

from tests import launch

E2E_CONFIG = launch.ROOT / "tests" / "configs" / "e2e.yaml"


def e2e_args(*, max_steps: int, name: str = "e2e", overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    return ["--config", str(E2E_CONFIG), f"run.name={name}", f"train.max_steps={max_steps}", *overrides]
