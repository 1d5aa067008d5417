"""models/forward.py: every output of the one forward, bitwise as the module's own call; what a
family reads besides tokens (media, its own positions) and says besides its result (auxiliary
losses, metrics); and no other call of the model anywhere in models/ or training/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import models
from core.config import ModelConfig
from core.exceptions import ConfigError
from models.forward import INPUT_TOKEN, AuxLoss, ModelInputs, ModelMetric, ModelOutput, model_forward, record_emitted
from models.generation.kv_cache import KVCache
from training.linear_cross_entropy import linear_cross_entropy

ROOT = Path(__file__).resolve().parents[2]
TINY = ModelConfig(
    arch="qwen3", vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, attention="sdpa",
)


@pytest.fixture(scope="module")
def model():
    return models.build(TINY, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def packed():
    """Two rows of two packed documents each, positions restarting per document."""
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(0, TINY.vocab_size, (2, 12), generator=generator)
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
    positions = torch.cat([torch.cat([torch.arange(5), torch.arange(7)])[None],
                           torch.cat([torch.arange(9), torch.arange(3)])[None]])
    labels = torch.randint(0, TINY.vocab_size, (2, 12), generator=generator)
    return ModelInputs(ids, positions, documents), labels


def test_logits_are_the_module_call_bit_for_bit(model, packed):
    inputs, _ = packed
    out = model_forward(model, inputs)
    want = model(inputs.input_ids, position_ids=inputs.position_ids, document_ids=inputs.document_ids)
    assert out.hidden is None and out.head is None and out.aux_losses == {} and out.extra == {}
    assert torch.equal(out.logits, want)


def test_hidden_states_are_what_the_output_projection_reads(model, packed):
    inputs, _ = packed
    out = model_forward(model, inputs, hidden=True)
    assert out.logits is None and out.hidden.shape == (2, 12, TINY.hidden_size)
    assert torch.equal(model.lm_head(out.hidden), model_forward(model, inputs).logits)


def test_a_fused_head_gets_the_hidden_states_and_the_output_weight(model, packed):
    inputs, labels = packed

    def fused(hidden, weight):
        return linear_cross_entropy(hidden, weight, labels, chunk_tokens=5)

    out = model_forward(model, inputs, head=fused)
    want = model(inputs.input_ids, position_ids=inputs.position_ids, document_ids=inputs.document_ids, head=fused)
    assert out.logits is None and torch.equal(out.head, want)
    plain = torch.nn.functional.cross_entropy(model_forward(model, inputs).logits.reshape(-1, TINY.vocab_size),
                                              labels.reshape(-1), reduction="sum")
    torch.testing.assert_close(out.head, plain)


def test_place_moves_the_three_tensors_it_reads(model, packed):
    inputs, _ = packed
    moved = []

    def place(tensor):
        moved.append(tensor)
        return tensor.clone()

    out = model_forward(model, inputs, place=place)
    assert [id(t) for t in moved] == [id(inputs.input_ids), id(inputs.position_ids), id(inputs.document_ids)]
    assert torch.equal(out.logits, model_forward(model, inputs).logits)


def test_the_cached_decode_is_the_same_forward_with_a_cache(model):
    ids = torch.randint(0, TINY.vocab_size, (2, 7), generator=torch.Generator().manual_seed(6))
    positions = torch.arange(7).expand(2, 7)
    with torch.no_grad():
        full = model_forward(model, ModelInputs(ids)).logits  # (B, T, vocab)
        cache = KVCache.for_spec(model.generation_spec(), batch=2, slots=8)
        model_forward(model, ModelInputs(ids[:, :4], positions[:, :4]), cache=cache)  # a prefill chunk
        steps = [model_forward(model, ModelInputs(ids[:, t:t + 1], positions[:, t:t + 1]), cache=cache).logits
                 for t in range(4, 7)]
    for t, logits in zip(range(4, 7), steps):
        assert logits.shape == (2, TINY.vocab_size)
        torch.testing.assert_close(logits, full[:, t], rtol=1e-5, atol=1e-5)


def test_conflicting_requests_are_refused(model, packed):
    inputs, _ = packed
    with pytest.raises(ValueError, match="at most one of head, hidden and cache"):
        model_forward(model, inputs, hidden=True, head=lambda hidden, weight: hidden)
    cache = KVCache.for_spec(model.generation_spec(), batch=2, slots=16)
    with pytest.raises(ValueError, match="neither document_ids nor a head"):
        model_forward(model, inputs, cache=cache)  # packed documents cannot be decoded
    assert isinstance(model_forward(model, ModelInputs(inputs.input_ids)), ModelOutput)


def test_qwen_positions_are_the_batchs_own(model, packed):
    inputs, _ = packed
    assert model.model_positions(inputs.input_ids, inputs.position_ids, None) is inputs.position_ids
    assert torch.equal(model.model_positions(inputs.input_ids, None, None), torch.arange(12)[None])


def test_qwen_refuses_media_it_cannot_read(model, packed):
    inputs, _ = packed
    with pytest.raises(ConfigError, match="reads token ids only") as refused:
        model_forward(model, ModelInputs(inputs.input_ids, media={"pixels": [[torch.zeros(4, 3)], []]}))
    assert refused.value.context["key"] == "model.arch"
    plain = model_forward(model, ModelInputs(inputs.input_ids, media={})).logits  # a data Batch without media has {}
    assert torch.equal(plain, model_forward(model, ModelInputs(inputs.input_ids)).logits)


class MediaFamily(torch.nn.Module):
    """A family that reads media and builds (3, B, T) positions, and says more than its result."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(4, 5, bias=False)
        self.seen: dict = {}

    def model_positions(self, input_ids, position_ids, media):
        return position_ids.expand(3, *position_ids.shape) + media["grid"].sum()  # (3, B, T)

    def forward(self, input_ids, position_ids=None, document_ids=None, head=None, cache=None, media=None):
        self.seen = {"positions": self.model_positions(input_ids, position_ids, media), "media": media}
        hidden = input_ids[..., None].float().expand(*input_ids.shape, 4) * self.lm_head.weight.sum()
        result = head(hidden, self.lm_head.weight) if head is not None else self.lm_head(hidden)
        aux = {"balance": AuxLoss(hidden.sum(), per=INPUT_TOKEN, weight=0.5)}
        metrics = {"load/0": ModelMetric(hidden.detach().sum(), input_ids.numel())}
        return ModelOutput(**({"head": result} if head is not None else {"logits": result}), aux_losses=aux,
                           metrics=metrics)


def test_a_family_gets_its_media_placed_and_returns_its_aux_losses_and_metrics():
    family = MediaFamily()
    ids, positions = torch.ones(2, 3, dtype=torch.long), torch.arange(3).expand(2, 3)
    grid = torch.tensor([1, 2, 2])
    inputs = ModelInputs(ids, positions, media={"grid": grid, "patches": [[torch.zeros(2)], []]})
    moved = []

    def place(tensor):
        moved.append(tensor)
        return tensor.clone()

    out = model_forward(family, inputs, place=place)
    assert out.logits.shape == (2, 3, 5) and set(out.aux_losses) == {"balance"} and set(out.metrics) == {"load/0"}
    assert any(t is grid for t in moved) and family.seen["media"]["grid"] is not grid  # placed like the ids
    assert family.seen["positions"].shape == (3, 2, 3)
    hidden = model_forward(family, inputs, hidden=True)
    assert hidden.head is None and hidden.hidden.shape == (2, 3, 4) and set(hidden.aux_losses) == {"balance"}
    with pytest.raises(ValueError, match="averaged over one of"):
        AuxLoss(torch.zeros(()), per="token")


def test_the_step_collects_only_the_trained_models_forwards_with_gradients():
    trained, frozen = MediaFamily(), MediaFamily()
    inputs = ModelInputs(torch.ones(1, 2, dtype=torch.long), torch.arange(2)[None], media={"grid": torch.ones(1)})
    model_forward(trained, inputs)  # outside a step: nothing collects, nothing kept
    with record_emitted([trained]) as emitted:
        first = model_forward(trained, inputs)
        model_forward(frozen, inputs)  # another module (a teacher)
        with torch.no_grad():
            model_forward(trained, inputs)  # no gradients: nothing to train
    assert emitted.outputs == [first]
    assert [name for name, _ in emitted.aux_losses()] == ["balance"]
    assert [name for name, _ in emitted.metrics()] == ["load/0"]


# ---------------------------------------------------------------------- the one call site

FORWARD_MODULE = "models/forward.py"
MODEL_DEFINITIONS = {"models/qwen/model.py", "models/qwen3_moe/model.py", "models/qwen_vl/model.py"}
# Inside a model's own forward: its dispatch to the cached path, its blocks' cached forwards.
INTERNAL_CALLS = ("self._forward_cached(", "block.forward_cached(", "self_attn.forward_cached(")
NOT_OURS = {"benchmarks/hf_baseline.py"}  # runs the transformers implementation, the baseline
MODEL_KEYWORDS = {"position_ids", "document_ids", "head", "cache"}
MODEL_NAMES = {"model", "_model", "module", "policy", "reference", "teacher"}


def model_calls(source: str) -> list[int]:
    """Line numbers of calls that look like running the model directly: a callee named like a
    model (``model(...)``, ``self.teacher.module(...)``), a call passing the model's keywords or
    ``<batch>.input_ids`` first, or a ``forward``/``forward_cached`` method called by name."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name == "model_forward" or (name or "a")[0].isupper():  # the helper; a class (Batch(...))
            continue
        first = node.args[0] if node.args else None
        # A model's head is a function; ``head=<a comparison or constant>`` is some other flag.
        keywords = {k.arg for k in node.keywords
                    if not (k.arg == "head" and isinstance(k.value, (ast.Compare, ast.Constant, ast.BoolOp)))}
        if (name in MODEL_NAMES or name in {"forward", "forward_cached", "_forward_cached"}
                or keywords & MODEL_KEYWORDS
                or (isinstance(first, ast.Attribute) and first.attr == "input_ids")):
            lines.append(node.lineno)
    return lines


def test_the_model_runs_only_through_model_forward():
    """models/, training/ and benchmarks/ call the model in one place; a new caller goes through
    model_forward."""
    found = []
    for layer in ("models", "training", "benchmarks"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative == FORWARD_MODULE or relative in NOT_OURS:
                continue
            lines = model_calls(path.read_text())
            if relative in MODEL_DEFINITIONS:  # inside a model: its blocks' cached forwards
                text = path.read_text().splitlines()
                lines = [n for n in lines if not any(inner in text[n - 1] for inner in INTERNAL_CALLS)]
            found += [f"{relative}:{n}" for n in lines]
    assert not found, "the model is called outside models/forward.py:\n" + "\n".join(found)
    tree = ast.parse((ROOT / FORWARD_MODULE).read_text())
    calls = [node.lineno for node in ast.walk(tree)
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "model"]
    assert len(calls) == 1, f"model_forward should call the model once, calls at lines {calls}"


def test_the_scan_sees_a_direct_call():
    source = (
        "def loss(self, model, placed):\n"
        "    a = model(placed.input_ids)\n"
        "    b = self.teacher.module(ids, head=h)\n"
        "    c = wrapped(placed.input_ids)\n"
        "    d = self.sampler.model.forward_cached(ids, positions, cache)\n"
        "    e = Batch(input_ids=ids, position_ids=positions)\n"
        "    f = role(param, head=name in heads)\n"
        "    g = wrapped(ids, head=h)\n"
        "    return model_forward(model, placed, head=h)\n"
    )
    assert model_calls(source) == [2, 3, 4, 5, 8]
