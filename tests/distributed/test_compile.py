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


def test_compiled_moe_blocks_trace_the_expert_loop_once_for_every_routing():
    # The loop splits its rows by the routing's per-expert counts. Traced as symbols, one graph serves
    # every routing; broken on, dynamo recompiled the block per routing until its limit sent it back to
    # eager (distributed/compile.py).
    from torch._dynamo.utils import counters

    from distributed.compile import apply_compile
    from models.builder import build
    from models.forward import ModelInputs, model_forward
    from tests.models.test_qwen3_moe import _config

    torch._dynamo.reset()
    counters.clear()
    model = build(_config(), generator=torch.Generator().manual_seed(0))
    eager = build(_config(), generator=torch.Generator().manual_seed(0))
    graphs = []
    with torch._dynamo.config.patch(capture_scalar_outputs=False):  # apply_compile sets it; undone after
        apply_compile(model, backend="eager")  # dynamo's tracing is the subject: its graphs run eagerly
        for seed in range(3):  # three batches of random ids: three routings
            ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
            out = model_forward(model, ModelInputs(ids))
            out.logits.square().mean().backward()
            want = model_forward(eager, ModelInputs(ids))
            assert torch.equal(out.logits, want.logits)
            graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[0] > 0 and graphs[0] == graphs[1] == graphs[2], graphs
    torch._dynamo.reset()
