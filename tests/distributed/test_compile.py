"""parallelize with compile (and checkpointing) trains like eager, under plain names.

One process: inductor on CPU takes ~15 s here for the tiny model; the multi-rank
compiled path is left to the GPU runs.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import scenarios


@pytest.mark.slow  # compiles forward and backward from a cold cache (about 34 CPU-s): in make test, not in make test-fast
def test_compiled_blocks_train_like_eager():
    eager = scenarios.train(scenarios.cpu_parallel(strategy="none"))
    compiled = scenarios.train(
        scenarios.cpu_parallel(strategy="none", compile=True, activation_checkpointing="full")
    )
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled["grad_norms"], eager["grad_norms"], rtol=1e-5, atol=1e-6)
    assert compiled["names"] == eager["names"]
    assert compiled["state_dict_keys"] == eager["state_dict_keys"]
    assert compiled["hash_before"] == eager["hash_before"]
