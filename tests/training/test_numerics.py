"""One numerics owner (models/numerics.py): a run builds its ``Numerics`` once (training/determinism.py,
training/builders.py), and the training forward and the sampler both run under that object."""

from __future__ import annotations

import pytest
import torch
import torch.utils.deterministic
from torch.nn.attention import SDPBackend

from core import config as config_lib
from core.config import ModelConfig
from models.numerics import Numerics
from tests import launch
from training import determinism

CONFIG = launch.ROOT / "tests" / "configs" / "e2e-grpo.yaml"
CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.fixture
def restore_torch_flags():
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.utils.deterministic.fill_uninitialized_memory = saved[1]
    torch.backends.cuda.matmul.allow_tf32 = saved[2]
    (torch.backends.cudnn.allow_tf32, torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) = saved[3:]


def test_the_run_s_numerics_come_from_its_sections():
    config = config_lib.load(str(CONFIG), ["parallel.device=cpu", "determinism.mode=fast", "model.attention=flex",
                                           "model.sdpa_backends=all", "parallel.precision=bf16"])
    assert determinism.numerics(config) == Numerics(mode="fast", attention="flex", sdpa_backends="all",
                                                    precision="bf16")


def test_a_model_outside_a_run_keeps_today_s_choices():
    numerics = Numerics.for_model(ModelConfig())
    assert numerics == Numerics(mode="bitwise", attention="auto", sdpa_backends="deterministic", precision="fp32")
    assert numerics.sdpa_backends_on(CUDA) == [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    assert numerics.sdpa_backends_on(CPU) is None
    assert Numerics(sdpa_backends="all").sdpa_backends_on(CUDA) is None
    assert numerics.cached_attention(torch.float32) == "fp32" and numerics.cached_attention(torch.bfloat16) == "sdpa"
    assert numerics.compute_dtype == torch.float32 and numerics.generation_dtype(CUDA) is None
    bf16 = Numerics(precision="bf16")
    assert bf16.compute_dtype == torch.bfloat16
    assert bf16.generation_dtype(CUDA) == torch.bfloat16 and bf16.generation_dtype(CPU) is None
    assert not numerics.allow_tf32 and Numerics(mode="fast").allow_tf32


def test_the_training_forward_and_the_sampler_run_under_one_numerics(restore_torch_flags):
    from core.distributed_context import DistributedContext
    from distributed import unwrap
    from models.generation.sampler import SamplingParams
    from training.builders import build_model
    from training.rollout.generation_model import generation_model
    from training.rollout.generator import Generator

    config = config_lib.load(str(CONFIG), ["parallel.device=cpu", "model.attention=auto"])
    with DistributedContext.from_env(config.parallel) as dist:
        model, _ = build_model(config, dist)
        trained = unwrap(model)
        numerics = trained.numerics
        assert numerics == determinism.numerics(config)
        assert all(block.self_attn.numerics is numerics for block in trained.layers)  # the training forward's
        generator = Generator(rows=2, max_len=16, seed=0)
        generator.load(model)
        sampler = generator._sampler
        assert sampler.numerics is numerics and sampler.model.numerics is numerics
        copy = generation_model(model, dtype=torch.float64)  # a fresh copy carries the same object
        assert copy is not trained and copy.numerics is numerics
        assert all(block.self_attn.numerics is numerics for block in copy.layers)
    # The decisions both take: the packed batch's kernel for this config, the sampling rule's kernels.
    assert numerics.attention_kernel(CUDA, config.data.seq_len) == ("flex" if config.data.seq_len % 128 == 0
                                                                    else "sdpa")
    rule = sampler._rule(SamplingParams(top_p=0.9))
    assert (rule.keywords["cut"], rule.keywords["draw"]) == numerics.sampling_kernels(CPU)


def test_the_loop_s_precision_and_the_lora_base_dtype_come_from_the_run_s_numerics():
    from training.precision import Precision

    bf16, fp16, fp32 = Numerics(precision="bf16"), Numerics(precision="fp16"), Numerics(precision="fp32")
    assert Precision(bf16, device=CPU, wrapper_casts=False).dtype == torch.bfloat16
    assert Precision(fp16, device=CPU, wrapper_casts=False).dtype == torch.float16
    assert not Precision(bf16, device=CPU, wrapper_casts=True).use_autocast  # FSDP's policy casts instead
    assert Precision(fp32, device=CPU, wrapper_casts=False).state_dict()["name"] == "fp32"
    assert bf16.frozen_base_dtype == torch.bfloat16  # models.lora.store_base_as
    assert fp16.frozen_base_dtype is None and fp32.frozen_base_dtype is None


def test_under_batch_invariance_the_blocks_are_not_compiled(restore_torch_flags):
    """A compiled block runs the stock kernels (dynamo traces it without the batch-invariant
    function mode): under determinism.batch_invariant, parallel.compile leaves the blocks eager."""
    from core.distributed_context import DistributedContext
    from distributed import unwrap
    from distributed.model_structure import plan_blocks
    from training.builders import build_model

    def compiled(overrides: list[str]) -> list[bool]:
        config = config_lib.load(str(CONFIG), ["parallel.device=cpu", "parallel.compile=true", *overrides])
        with DistributedContext.from_env(config.parallel) as dist:
            model, _ = build_model(config, dist)
            return [getattr(block, "_compiled_call_impl", None) is not None
                    for _, _, block in plan_blocks(unwrap(model))]

    assert all(compiled([])) and compiled([])
    assert not any(compiled(["determinism.batch_invariant=true"]))
