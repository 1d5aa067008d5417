"""A reward model's score of a sequence does not depend on the world size (training/objectives/model_reward.py).

Every reward-model forward has the config's one shape (``score_shape``: micro_batch_size x
group_size rows of data.seq_len rounded up to 128 tokens, dummy rows filling the last chunk), so
the same global rows scored as one rank's chunks, as two ranks' shards, a prompt's group alone or
each sequence alone give bitwise-equal scores (a GEMM of 1 row differs in the last bits from the
same row among 8 on the CPU: docs/models.md, "Batch invariance"); and as the score head runs over
every position, forwards of 1 to 16 rows (micro-batch sizes) give them too.
"""

from __future__ import annotations

import random

import pytest
import torch

import models
from core import config as config_lib
from core import seeding
from tests import launch
from training.objectives import reward_model
from training.objectives.frozen import FrozenModel
from training.objectives.model_reward import ModelReward, ScoreShape, score_shape, weighted_scores

GRPO_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-grpo.yaml"
GROUP = 4
PROMPTS = 4
PAD = 257
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def config():
    return config_lib.load(str(GRPO_CONFIG))


@pytest.fixture(scope="module")
def reward(config):
    """A reward model of the e2e policy's shape with seeded random weights."""
    trunk = models.build(config.model, generator=seeding.generator(3, "reward_init")).eval().requires_grad_(False)
    head = torch.nn.Linear(config.model.hidden_size, 1, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.5, generator=seeding.generator(3, "score_init"))
    identity = {"path": "seeded", "sha256": "-"}
    return ModelReward(FrozenModel(role="reward", module=trunk, identity=identity, vocab_size=config.model.vocab_size),
                       head, identity)


@pytest.fixture(scope="module")
def sequences(config):
    """PROMPTS x GROUP prompt + completion id sequences in global row order (prompt row * GROUP + sample),
    of lengths from 1 token to data.seq_len."""
    rng = random.Random(47)
    lengths = [1, config.data.seq_len] + [rng.randrange(2, config.data.seq_len) for _ in range(PROMPTS * GROUP - 2)]
    return [[rng.randrange(3, config.model.vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads on a busy machine wait on each other
    yield
    torch.set_num_threads(threads)


def test_the_shape_is_a_constant_of_the_config(config):
    assert score_shape(config, group_size=GROUP) == ScoreShape(rows=config.train.micro_batch_size * GROUP, width=128)
    longer = config_lib.load(str(GRPO_CONFIG), ["data.seq_len=129"])
    assert score_shape(longer, group_size=GROUP).width == 256


def test_every_forward_has_the_shape_whatever_the_number_of_sequences(config, reward, sequences, monkeypatch):
    shape = score_shape(config, group_size=GROUP)
    seen = []
    scores = reward_model.sequence_scores

    def recording(model, head, input_ids, *args):
        seen.append(tuple(input_ids.shape))
        return scores(model, head, input_ids, *args)

    monkeypatch.setattr(reward_model, "sequence_scores", recording)
    for count in (1, 5, 8, 13):
        seen.clear()
        assert len(reward.scores(sequences[:count], shape=shape, device=CPU, pad_id=PAD)) == count
        assert seen == [(shape.rows, shape.width)] * -(-count // shape.rows), count


def test_the_same_rows_score_bitwise_alike_on_one_rank_two_ranks_and_alone(config, reward, sequences):
    shape = score_shape(config, group_size=GROUP)
    one_rank = weighted_scores([(0.5, reward)], sequences, shape=shape, device=CPU, pad_id=PAD).tolist()
    # Two ranks: rank r holds the prompts of streams s = r (mod 2), here prompt rows 0, 2 and 1, 3.
    by_row = {}
    for rank in (0, 1):
        rows = [p * GROUP + j for p in range(rank, PROMPTS, 2) for j in range(GROUP)]
        shard = weighted_scores([(0.5, reward)], [sequences[i] for i in rows], shape=shape, device=CPU, pad_id=PAD)
        by_row.update(zip(rows, shard.tolist()))
    assert [by_row[i] for i in range(len(sequences))] == one_rank
    groups = [s for p in range(PROMPTS)
              for s in reward.scores(sequences[p * GROUP:(p + 1) * GROUP], shape=shape, device=CPU, pad_id=PAD)]
    alone = [reward.scores([s], shape=shape, device=CPU, pad_id=PAD)[0] for s in sequences]
    assert [0.5 * s for s in groups] == [0.5 * s for s in alone] == one_rank
    assert len(set(one_rank)) == len(one_rank)  # the scores differ: no constant reward passes


def test_a_score_does_not_change_with_the_rows_per_forward(reward, sequences):
    """``rows`` is micro_batch_size x group_size: 1 against 4 micro-batch rows score alike too."""
    by_rows = {rows: reward.scores(sequences, shape=ScoreShape(rows=rows, width=128), device=CPU, pad_id=PAD)
               for rows in (1, 2, 3, 5, 8, 16)}
    assert all(scores == by_rows[8] for scores in by_rows.values()), {
        rows: sum(a != b for a, b in zip(scores, by_rows[8])) for rows, scores in by_rows.items()}


def test_a_sequence_longer_than_the_width_is_refused(config, reward):
    shape = ScoreShape(rows=2, width=8)
    with pytest.raises(ValueError, match="9 tokens.*width of 8"):
        reward.scores([[5] * 9], shape=shape, device=CPU, pad_id=PAD)
