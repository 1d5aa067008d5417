"""The reward_model objective: a sequence's score is the score head on the final hidden state at
its last token, whatever follows it in the row; the loss is the Bradley-Terry loss of those scores
computed by hand; its checks refuse what it cannot train."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import models
from core import seeding
from core.config import config_hash, load, to_dict
from core.exceptions import ConfigError
from data.batch import Batch, DocSpan
from data.fields import TARGET_MASK
from data.preference import PAIR_MARGIN, PAIR_ROLE
from training.objectives.base import ObjectiveContext
from training.objectives.reward_model import SCORE_PART, RewardModelObjective, score_layout, sequence_scores

T = 32
TINY = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
        "model.num_kv_heads=1", "model.head_dim=16", "parallel.strategy=none", "objective.kind=reward_model",
        "data.sources=[{path: datasets/tasks/pref/train, name: p, record: preference}]"]
# (start, response start, end) of each document: row 0 holds two pairs, row 1 one pair and padding.
DOCS = ([(0, 5, 8), (8, 13, 16), (16, 21, 24), (24, 29, 32)], [(0, 6, 10), (10, 16, 20)])


def _batch(pair_margins=None) -> Batch:
    """``pair_margins``: per row, each pair's margin (the extra ``pair_margin``, as data/preference.py carries it)."""
    rng = np.random.default_rng(0)
    tokens, spans, masks, roles, margins = [], [], [], [], []
    for row, docs in enumerate(DOCS):
        ids = rng.integers(0, 256, T).astype(np.int32)
        mask, role, row_spans = np.zeros(T, dtype=bool), np.zeros(T, dtype=np.int8), []
        margin = np.zeros(T, dtype=np.float32)
        for d, (lo, resp, hi) in enumerate(docs):
            mask[resp:hi] = True
            role[lo:hi] = 1 + d % 2
            row_spans.append(DocSpan("s", "f", row * 10 + d // 2, lo, hi, d % 2))
            if pair_margins is not None:
                margin[lo:hi] = pair_margins[row][d // 2]
        if docs[-1][2] < T:
            row_spans.append(DocSpan("<padding>", "", -1, docs[-1][2], T, 0))
        tokens.append(ids), spans.append(row_spans), masks.append(mask), roles.append(role), margins.append(margin)
    fields = {TARGET_MASK: masks, PAIR_ROLE: roles} | ({PAIR_MARGIN: margins} if pair_margins is not None else {})
    return Batch.from_rows(1, tokens, spans, [0, 1], {}, fields)


def _objective(overrides=()):
    config = load(None, [*TINY, "objective.reward_model.margin=0.25", "objective.reward_model.center_coef=0.1",
                         *overrides])
    model = models.build(config.model, generator=seeding.generator(0, "model_init"))
    dist = SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=torch.device("cpu"), backend="gloo")
    objective = RewardModelObjective(config)
    context = ObjectiveContext(config=config, dist=dist, parallel=SimpleNamespace(device=dist.device),
                               place=lambda t: t)
    objective.setup(model, context)
    parts = {name: spec.module for name, spec in objective.extra_parts(context).items()}
    return objective, model, parts


def _alone(model, head, ids: torch.Tensor) -> float:
    """The score of one sequence run on its own: the head on the final hidden state at its last token."""
    n = ids.numel()
    with torch.no_grad():
        return float(sequence_scores(model, head, ids[None], torch.arange(n)[None], torch.zeros(1, n, dtype=torch.long),
                                     torch.tensor([0]), torch.tensor([n - 1]))[0])


def test_the_layout_reads_each_side_of_each_pair_before_its_separator():
    # Each side ends with the separator the packer lays after it (positions 7, 15, 23, 31 and 9, 19):
    # the read position is the token before it, the rendered conversation's last token.
    layout = score_layout(_batch())
    assert layout.rows.tolist() == [0, 0, 1]
    assert layout.chosen.tolist() == [6, 22, 8]
    assert layout.rejected.tolist() == [14, 30, 18]


def test_a_score_is_the_sequence_alone_at_its_last_token_whatever_follows_it():
    objective, model, parts = _objective()
    batch, head = _batch(), parts[SCORE_PART]
    layout = score_layout(batch)
    with torch.no_grad():
        packed = sequence_scores(model, head, batch.input_ids, batch.position_ids, batch.document_ids,
                                 layout.rows, layout.chosen)
    for k, (row, end) in enumerate(zip(layout.rows.tolist(), layout.chosen.tolist())):
        start = next(s.start for s in batch.provenance[row] if s.start <= end < s.end)
        ids = batch.input_ids[row, start:end + 1]
        alone = _alone(model, head, ids)
        assert packed[k].item() == pytest.approx(alone, abs=1e-5)
        # Tokens after the sequence's last one (another document, padding) do not change it, and the
        # score is read at the last token: dropping that token changes it.
        followed = torch.cat([ids, torch.tensor([3, 1, 4, 1, 5])])
        with torch.no_grad():
            n = followed.numel()
            doc = torch.tensor([[0] * ids.numel() + [1] * 5])
            pos = torch.cat([torch.arange(ids.numel()), torch.arange(5)])[None]
            after = sequence_scores(model, head, followed[None], pos, doc, torch.tensor([0]),
                                    torch.tensor([ids.numel() - 1]))
        assert after[0].item() == pytest.approx(alone, abs=1e-5)
        assert _alone(model, head, ids[:-1]) != pytest.approx(alone, abs=1e-6)
        assert n == ids.numel() + 5


@pytest.mark.parametrize("per_record", [False, True])
def test_the_loss_is_bradley_terry_with_margin_and_centering_by_hand(per_record):
    """A fixed margin 0.25, or each pair's own (1.5 and -0.5 in row 0, 2.0 in row 1) under margin_from: record."""
    own = ((1.5, -0.5), (2.0,))
    record = ["objective.reward_model.margin=0", "objective.reward_model.margin_from=record"] if per_record else []
    objective, model, parts = _objective(record)
    batch, head = _batch(own if per_record else None), parts[SCORE_PART]
    out = objective.loss(model, batch, parts)
    assert out.count == 3 == objective.num_targets(batch)
    layout = score_layout(batch)
    expected, accuracy, margin = 0.0, 0.0, 0.0
    wanted = [m for row in own for m in row] if per_record else [0.25] * 3  # pairs in row-major order
    for row, c_end, r_end, m in zip(layout.rows.tolist(), layout.chosen.tolist(), layout.rejected.tolist(), wanted):
        c_start, r_start = _start(batch, row, c_end), _start(batch, row, r_end)
        chosen = _alone(model, head, batch.input_ids[row, c_start:c_end + 1])
        rejected = _alone(model, head, batch.input_ids[row, r_start:r_end + 1])
        gap = chosen - rejected
        expected += -math.log(1 / (1 + math.exp(-(gap - m)))) + 0.1 * (chosen + rejected) ** 2
        accuracy += float(gap > 0)
        margin += gap
    assert out.sum.item() == pytest.approx(expected, rel=1e-5)
    assert out.metrics["accuracies"].item() == accuracy
    assert out.metrics["margins"].item() == pytest.approx(margin, abs=1e-5)
    fields = objective.ledger_fields(batch, {k: v.item() for k, v in out.metrics.items()}, out.count)
    assert fields["pairs"] == 3 and fields["accuracy"] == accuracy / 3
    assert fields["margin"] == pytest.approx(margin / 3, abs=1e-5)


def _start(batch: Batch, row: int, end: int) -> int:
    """Where the document holding position ``end`` of ``row`` starts."""
    return next(s.start for s in batch.provenance[row] if s.start <= end < s.end)


def test_the_gradient_reaches_the_trunk_and_the_score_head():
    objective, model, parts = _objective()
    objective.loss(model, _batch(), parts).sum.backward()
    assert parts[SCORE_PART].weight.grad.abs().sum() > 0
    assert model.layers[0].mlp.down_proj.weight.grad.abs().sum() > 0


def test_the_score_head_starts_from_the_run_seed():
    a = _objective()[2][SCORE_PART].weight
    b = _objective()[2][SCORE_PART].weight
    c = _objective(["train.seed=7"])[2][SCORE_PART].weight
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("override, key", [
    ("objective.reward_model.center_coef=-1", "objective.reward_model.center_coef"),
    ("objective.reward_model.margin=.nan", "objective.reward_model.margin"),
    ("data.sources=[{path: datasets/tasks/sft/train, name: s, record: chat}]", "data.sources"),
    ("model.tie_embeddings=false", "model.tie_embeddings"),
    ("objective.reward_model.margin_from=record", "objective.reward_model.margin"),  # with margin 0.5 set below
    ("objective.reward_model.margin_from=pair", "objective.reward_model.margin_from"),
])
def test_bad_settings_are_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError) as error:
        load(None, [*TINY, "objective.reward_model.margin=0.5", override])
    assert key in str(error.value)


GRPO = ["objective.kind=grpo", "data.sources=[{path: datasets/tasks/rl/train, name: rl, record: prompt}]"]


@pytest.mark.parametrize("rewards, key", [
    ("[{name: model}]", "objective.grpo.rewards[0].path"),
    ("[{name: exact_answer, path: some/dir}]", "objective.grpo.rewards[0].path"),
])
def test_a_model_reward_names_its_path_and_only_it_does(rewards, key):
    with pytest.raises(ConfigError) as error:
        load(None, [*GRPO, f"objective.grpo.rewards={rewards}"])
    assert key in str(error.value)


def test_a_model_reward_refuses_dynamic_sampling():
    with pytest.raises(ConfigError) as error:
        load(None, [*GRPO, "objective.grpo.rewards=[{name: model, path: some/dir}]",
                    "objective.grpo.dynamic_sampling_rounds=2"])
    assert "objective.grpo.dynamic_sampling_rounds" in str(error.value)


def test_a_reward_path_enters_the_config_hash_only_when_set():
    plain = load(None, [*GRPO, "objective.grpo.rewards=[{name: exact_answer}, {name: format_regex, pattern: x}]"])
    with_model = load(None, [*GRPO, "objective.grpo.rewards=[{name: exact_answer}, {name: model, path: a/dir}]"])
    other_model = load(None, [*GRPO, "objective.grpo.rewards=[{name: exact_answer}, {name: model, path: b/dir}]"])
    assert len({config_hash(plain), config_hash(with_model), config_hash(other_model)}) == 3
    assert "path" in to_dict(plain)["objective"]["grpo"]["rewards"][0]  # the key exists; the hash leaves it out


def test_margins_are_read_from_the_records_only_under_margin_from_record():
    from core.objective_kinds import record_fields

    fixed = load(None, [*TINY, "objective.reward_model.margin=0.5"])
    record = load(None, [*TINY, "objective.reward_model.margin_from=record"])
    assert record_fields(fixed) == () and record_fields(record) == ("margin",)
    assert record_fields(load(None, GRPO)) == ()
    # margin_from enters the hash only when set: a config that never names it keeps its hash
    assert "margin_from" in to_dict(fixed)["objective"]["reward_model"]
    explicit = load(None, [*TINY, "objective.reward_model.margin=0.5", "objective.reward_model.margin_from=fixed"])
    assert config_hash(explicit) == config_hash(fixed) != config_hash(record)


def test_the_runs_pipelines_carry_the_records_margins_under_margin_from_record(tmp_path):
    """training/builders.py builds the training and the held-out pipelines with the objective's
    record fields: each pair's margin arrives as the extra pair_margin, read at its chosen end."""
    import json

    from training.builders import build_data

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "chosen": str(i + 1), "rejected": str(i + 2),
                                        "margin": 0.25 * i}) + "\n" for i in range(16)))
    source = f"{{path: {path}, record: preference}}"
    config = load(None, [*TINY, "objective.reward_model.margin_from=record", f"data.sources=[{source}]",
                         f"data.eval_source={source}", "data.num_streams=1", "train.global_batch_size=2",
                         "data.seq_len=512", "data.workers=0"])
    train, evaluation = build_data(config, SimpleNamespace(dp_rank=0, dp_size=1))
    with train as pipe, evaluation() as held_out:
        for batch in (next(pipe), next(held_out)):
            layout = score_layout(batch)
            margins = batch.extras["pair_margin"][layout.rows, layout.chosen].tolist()
            records = [next(s.record for s in batch.provenance[r] if s.start <= end < s.end)
                       for r, end in zip(layout.rows.tolist(), layout.chosen.tolist())]
            assert margins == [0.25 * record for record in records] and len(records) >= 2
