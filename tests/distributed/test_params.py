"""Plain names and the parameter hash through wrappers (compile, checkpointing, DDP)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from distributed import canonical_name, param_hash, unwrap
from distributed.activation_checkpoint import apply_activation_checkpointing
from distributed.compile import apply_compile
from distributed.params import canonical_named_parameters
from tests.distributed.scenarios import build_model


@pytest.fixture(autouse=True)
def _dynamo_config():
    """apply_compile's process-wide dynamo setting (distributed/compile.py), undone after each test."""
    with torch._dynamo.config.patch(capture_scalar_outputs=torch._dynamo.config.capture_scalar_outputs):
        yield


def _wrapped_model() -> torch.nn.Module:
    model = build_model()
    apply_activation_checkpointing(model, "full")
    apply_compile(model)  # compiles lazily: nothing is traced until a forward
    return model


def test_hash_is_reproducible_and_wrapper_independent():
    plain = param_hash(build_model())
    assert param_hash(build_model()) == plain
    assert param_hash(_wrapped_model()) == plain
    assert param_hash(torch.compile(build_model())) == plain


def test_hash_sees_one_ulp_and_the_dtype():
    model = build_model()
    plain = param_hash(model)
    with torch.no_grad():
        w = model.layers[1].mlp.down_proj.weight
        w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(float("inf")))
    assert param_hash(model) != plain
    assert param_hash(build_model().to(torch.bfloat16)) != plain


def test_checkpoint_wrapper_names_leak_only_into_named_parameters():
    model = _wrapped_model()
    plain_keys = set(build_model().state_dict())
    raw = [name for name, _ in model.named_parameters()]
    assert any("_checkpoint_wrapped_module" in name for name in raw)  # the documented leak
    assert set(model.state_dict()) == plain_keys  # the wrapper's own hook strips it
    assert set(get_model_state_dict(model)) == plain_keys
    assert {name for name, _ in canonical_named_parameters(model)} == plain_keys


def test_torch_compile_wrapper_is_unwrapped():
    model = build_model()
    compiled = torch.compile(model)
    assert unwrap(compiled) is model
    assert set(get_model_state_dict(compiled)) == set(model.state_dict())
    assert all(name.startswith("_orig_mod.") for name in compiled.state_dict())  # why unwrap exists


def test_canonical_name():
    assert canonical_name("layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert canonical_name("_orig_mod.layers.1._orig_mod.norm.weight") == "layers.1.norm.weight"
    assert canonical_name("lm_head.weight") == "lm_head.weight"


def test_tied_weight_is_hashed_under_both_names():
    names = [name for name, _ in canonical_named_parameters(build_model())]
    assert "lm_head.weight" in names and "embed_tokens.weight" in names


def test_fingerprint_sees_every_element_and_its_position(monkeypatch):
    from distributed import params

    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1000, generator=gen)
    reference = params.fingerprint(base)
    for index in (0, 1, 517, 999):
        flipped = base.clone()
        flipped.view(torch.int32)[index] ^= 1  # lowest mantissa bit
        assert not torch.equal(params.fingerprint(flipped), reference), index
    swapped = base.clone()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert not torch.equal(params.fingerprint(swapped), reference)
    assert not torch.equal(params.fingerprint(torch.tensor([0.0])), params.fingerprint(torch.tensor([-0.0])))
    # Chunked sums equal one pass: integer addition does not care about the order.
    monkeypatch.setattr(params, "_CHUNK", 64)
    assert torch.equal(params.fingerprint(base), reference)
    for dtype in (torch.bfloat16, torch.float16, torch.float64, torch.uint8, torch.bool):
        assert params.fingerprint(base.to(dtype)).dtype == torch.int64
