"""Rollout correction (training/objectives/rollout_correction.py): TIS's truncated token weights,
MIS's sequence ratios and masks, the mismatch statistics and their ledger fields against values
worked out by hand; the settings' checks and hash; GRPO's objective with stubbed rollouts (the
sampler's log-probs beside the trainer's, the weighted loss, and without the section the batch,
loss and ledger of before); PPO's policy loss weighed and its value loss not."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import models
from core import config as config_lib
from core import seeding
from core.exceptions import ConfigError
from data.batch import IGNORE_INDEX, Batch
from training.objectives.grpo import PARITY
from training.objectives.grpo_loss import per_token_loss, reduce_loss
from training.objectives.rollout_correction import (ABS_DIFF, CLIPPED, DIFF_MAX, KEEP, MASKED, ROLLOUT_LOGPS, ROWS,
                                                    TOKENS, correction_fields, mismatch_sums, policy_weights,
                                                    sequence_keep, sequence_log_ratios, token_weights)
from training.objectives.rollout_correction_settings import RolloutCorrectionSettings
from tests import launch
from tests.training.test_grpo import settings as surrogate
from tests.training.test_grpo_variants import _prepared

EXACT = dict(rtol=0.0, atol=1e-12)


def t(*rows):
    """Rows of a (B, T) float64 tensor."""
    return torch.tensor(rows, dtype=torch.float64)


def m(*rows):
    return torch.tensor(rows, dtype=torch.bool)


# ---------------------------------------------------------------- formulas by hand


def test_tis_weights_are_the_ratio_truncated_at_the_cap():
    train, rollout = t([-1.0, -2.0, -0.5], [-0.3, -0.3, -0.3]), t([-1.2, -1.0, -0.5], [-0.3, -0.3, -9.0])
    mask = m([True, True, False], [True, True, False])
    weights, clipped = token_weights(train, rollout, mask, cap=1.1)
    # row 0: d = 0.2 (e^0.2 = 1.2214 > 1.1: clipped to 1.1), d = -1 (e^-1 = 0.3679), off the mask 0
    # row 1: d = 0, 0 (weights 1); the third token's d = 8.7 is off the mask: neither weighed nor clipped
    torch.testing.assert_close(weights, t([1.1, math.exp(-1.0), 0.0], [1.0, 1.0, 0.0]), **EXACT)
    assert clipped.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    grad = train.clone().requires_grad_(True)
    assert not token_weights(grad, rollout, mask, cap=1.1)[0].requires_grad  # detached


def test_mis_ratio_is_the_geometric_mean_or_the_product():
    train = t([-1.0, -1.0, -2.0], [-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0])
    rollout = t([-1.5, -1.5, -7.0], [-1.3, -0.9, 0.0], [-1.0, -1.0, -1.0])
    mask = m([True, True, False], [True, True, False], [False, False, False])
    # row 0: d = 0.5, 0.5 -> product 1.0, geometric 0.5; row 1: d = 0.3, -0.1 -> 0.2 and 0.1; row 2: no token -> 0
    assert sequence_log_ratios(train, rollout, mask, "product") == pytest.approx([1.0, 0.2, 0.0], abs=1e-12)
    assert sequence_log_ratios(train, rollout, mask, "geometric") == pytest.approx([0.5, 0.1, 0.0], abs=1e-12)
    # [0.5, 2]: log-ratios in [-0.693, 0.693]; the product of row 0 (e^1 = 2.72) leaves it, its geometric mean
    # (e^0.5 = 1.65) does not: a product drops long completions for a per-token drift a mean forgives
    window = dict(mis_low=0.5, mis_high=2.0, tis_cap=None)
    product = sequence_keep(train, rollout, mask, RolloutCorrectionSettings(mis="product", **window))
    geometric = sequence_keep(train, rollout, mask, RolloutCorrectionSettings(mis="geometric", **window))
    assert product.tolist() == [0.0, 1.0, 1.0] and geometric.tolist() == [1.0, 1.0, 1.0]
    assert product.dtype == torch.float32
    tight = RolloutCorrectionSettings(mis="geometric", mis_low=0.9, mis_high=1.2, tis_cap=None)
    # log 0.9 = -0.105, log 1.2 = 0.182: row 0 (0.5) leaves, row 1 (0.1) and row 2 (0) stay
    assert sequence_keep(train, rollout, mask, tight).tolist() == [0.0, 1.0, 1.0]
    # the window is closed: exactly on the bound (ratio 1 in [1, 1]) is kept
    exact = RolloutCorrectionSettings(mis="product", mis_low=1.0, mis_high=1.0, tis_cap=None)
    assert sequence_keep(train, train, mask, exact).tolist() == [1.0, 1.0, 1.0]


def test_mis_ratio_is_summed_exactly_whatever_the_order():
    values = [1e16, 1.0, -1e16, 1.0]  # a float sum in this order gives 1.0 (or 0.0); the exact sum is 2
    train, rollout = t(values), t([0.0] * 4)
    assert sequence_log_ratios(train, rollout, m([True] * 4), "product") == [2.0]
    assert sequence_log_ratios(train, rollout, m([True] * 4), "geometric") == [0.5]


def test_policy_weights_combine_tis_and_the_mis_mask():
    train, rollout = t([-1.0, -2.0], [-1.0, -1.0]), t([-1.2, -1.0], [-1.1, -1.1])
    mask = m([True, True], [True, False])
    extras = {"old_logps": train, ROLLOUT_LOGPS: rollout, KEEP: torch.tensor([0.0, 1.0])}
    both = RolloutCorrectionSettings(tis_cap=1.1, mis="geometric")
    # row 0 masked by MIS; row 1: d = 0.1, e^0.1 = 1.105 > 1.1 -> 1.1; its second token is off the mask
    torch.testing.assert_close(policy_weights(extras, mask, both), t([0.0, 0.0], [1.1, 0.0]), **EXACT)
    tis_only = RolloutCorrectionSettings(tis_cap=1.1)
    torch.testing.assert_close(policy_weights(extras, mask, tis_only), t([1.1, math.exp(-1.0)], [1.1, 0.0]), **EXACT)
    mis_only = RolloutCorrectionSettings(tis_cap=None, mis="product")
    torch.testing.assert_close(policy_weights(extras, mask, mis_only), t([0.0, 0.0], [1.0, 0.0]), **EXACT)


def test_the_weights_multiply_the_surrogate_not_the_kl_penalty():
    logps, old = t([-1.0, -2.0]), t([-1.0, -2.0])  # ratio 1
    ref, mask, adv = t([-1.5, -2.0]), m([True, True]), torch.tensor([2.0], dtype=torch.float64)
    weights = t([0.5, 1.1])
    loss, _ = per_token_loss(logps, old, ref, adv, mask, surrogate(kl_coef=0.1), weights)
    k3 = math.exp(-0.5) + 0.5 - 1.0  # ref - logp = -0.5 on the first token, 0 on the second
    torch.testing.assert_close(loss, t([-0.5 * 2.0 + 0.1 * k3, -1.1 * 2.0]), **EXACT)
    # the gradient of the weighted surrogate is the weight times the unweighted one (the weight is a constant)
    grads = []
    for w in (None, weights):
        x = logps.clone().requires_grad_(True)
        per_token_loss(x, old, None, adv, mask, surrogate(), w)[0].sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0] * weights, **EXACT)
    # weights of 1 leave every bit of the loss as without weights
    unweighted, _ = per_token_loss(logps + 0.01, old, ref, adv, mask, surrogate(kl_coef=0.1))
    ones, _ = per_token_loss(logps + 0.01, old, ref, adv, mask, surrogate(kl_coef=0.1), torch.ones_like(logps))
    assert torch.equal(unweighted, ones)


def test_mismatch_sums_and_ledger_fields_by_hand():
    train, rollout = t([-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]), t([-1.2, -1.0, 0.0], [-0.5, -0.8, -3.0])
    mask = m([True, True, False], [True, True, False])
    extras = {"old_logps": train, ROLLOUT_LOGPS: rollout, KEEP: torch.tensor([1.0, 0.0])}
    settings = RolloutCorrectionSettings(tis_cap=1.2, mis="product")
    sums, maxima = mismatch_sums(extras, mask, settings)
    # |d| = 0.2, 1.0 | 0, 0.3 (the off-mask 2.5 not counted); e^0.2 = 1.2214 and e^0.3 = 1.3499 pass the cap 1.2
    assert {k: round(float(v), 12) for k, v in sums.items()} == {ABS_DIFF: 1.5, TOKENS: 4.0, CLIPPED: 2.0,
                                                                  MASKED: 1.0, ROWS: 2.0}
    assert float(maxima[DIFF_MAX]) == 1.0
    fields = correction_fields({**{k: float(v) for k, v in sums.items()}, DIFF_MAX: 1.0}, settings)
    assert fields == pytest.approx({"rollout_logp_diff_mean": 0.375, "rollout_logp_diff_max": 1.0,
                                    "tis_clipped_fraction": 0.5, "mis_masked_fraction": 0.5}, abs=1e-12)
    # only the enabled correction's fields
    tis = RolloutCorrectionSettings(tis_cap=2.0)
    sums, _ = mismatch_sums(extras, mask, tis)
    assert set(sums) == {ABS_DIFF, TOKENS, CLIPPED}
    assert set(correction_fields({**sums, DIFF_MAX: 1.0}, tis)) == {"rollout_logp_diff_mean",
                                                                    "rollout_logp_diff_max", "tis_clipped_fraction"}


# ---------------------------------------------------------------- settings


def test_settings_are_checked_naming_the_key_and_hashed_only_when_set():
    for kind in ("grpo", "ppo"):
        path = launch.ROOT / "configs" / f"tiny-{kind}.yaml"
        default = config_lib.load(path)
        key = f"objective.{kind}.rollout_correction"
        assert getattr(default.objective, kind).rollout_correction is None
        assert config_lib.load(path, [f"{key}=null"]).hash == default.hash
        on = config_lib.load(path, [f"{key}.tis_cap=2.0"])
        assert getattr(on.objective, kind).rollout_correction == RolloutCorrectionSettings()
        assert on.hash != default.hash
        mis = config_lib.load(path, [f"{key}.mis=geometric", f"{key}.mis_low=0.999", f"{key}.mis_high=1.001"])
        assert mis.hash not in (on.hash, default.hash)
        bad = [(["tis_cap=0"], "tis_cap"), (["tis_cap=.inf"], "tis_cap"), (["mis_low=0"], "mis_low"),
               (["mis_low=1.5"], "mis_low"), (["mis_high=0.9"], "mis_high"), (["mis=median"], "mis"),
               (["tis_cap=null"], None)]
        for overrides, name in bad:
            with pytest.raises(ConfigError) as info:
                config_lib.load(path, [f"{key}.{o}" for o in overrides])
            assert info.value.context["key"] == (f"{key}.{name}" if name else key), overrides
            assert info.value.exit_code == 2


# ---------------------------------------------------------------- GRPO's objective (stubbed rollouts)

CORRECTION = "objective.grpo.rollout_correction"


@pytest.mark.usefixtures("in_tasks_workdir")
def test_grpo_without_the_section_keeps_its_batch_loss_and_ledger():
    _, model, objective, batch, _ = _prepared()
    assert objective.correction is None and set(batch.extras) == {"advantages", "old_logps"}
    out = objective.loss(model, batch)
    # the loss is the unweighted surrogate of the sampler's log-probs, bit for bit
    mask = batch.labels != IGNORE_INDEX
    logps = objective._token_logps(model, batch, fuse=False).float()
    per_token, _ = per_token_loss(logps, batch.extras["old_logps"], None, batch.extras["advantages"], mask,
                                  objective.settings)
    assert torch.equal(out.sum, reduce_loss(per_token, mask, objective.g.loss_norm))
    assert set(out.metrics) == {"clip_fraction", "entropy"} and set(out.maxima) == {PARITY}
    fields = objective.ledger_fields(batch, {PARITY: 0.0}, 0)
    assert not {"rollout_logp_diff_mean", "rollout_logp_diff_max", "tis_clipped_fraction",
                "mis_masked_fraction"} & set(fields)


@pytest.mark.usefixtures("in_tasks_workdir")
def test_grpo_with_tis_and_mis_weighs_the_trainers_ratio():
    # The stub's log-probs (-2.0 + 0.1 t) are far from the seeded model's (about -ln(vocab)): a real mismatch.
    # A wide geometric window keeps some completions and drops others; the cap clips some tokens.
    _, model, objective, batch, _ = _prepared([f"{CORRECTION}.tis_cap=1.0e-2", f"{CORRECTION}.mis=geometric",
                                               f"{CORRECTION}.mis_low=0.012", f"{CORRECTION}.mis_high=1.0"])
    settings = objective.correction
    mask = batch.labels != IGNORE_INDEX
    sampler = batch.extras[ROLLOUT_LOGPS]
    logps = objective._token_logps(model, batch, fuse=False).float()  # the loss's forward
    trainer = batch.extras["old_logps"]  # prepare's forward, micro-batch by micro-batch
    assert sampler[mask].tolist() == pytest.approx([-2.0 + 0.1 * i for n in (3, 6, 5, 6) for i in range(n)] * 4)
    assert torch.allclose(trainer, logps, rtol=0, atol=1e-6)  # the clipped ratio's old policy is the trainer's
    # MIS by hand: each completion's mean log-ratio (-4.33 to -4.50 here) against [ln 0.012, 0] = [-4.42, 0]
    keep = []
    for row in range(batch.labels.shape[0]):
        d = [float(a) - float(b) for a, b in zip(trainer[row][mask[row]], sampler[row][mask[row]])]
        keep.append(1.0 if math.log(0.012) <= sum(d) / len(d) <= 0.0 else 0.0)
    assert batch.extras[KEEP].tolist() == keep and 0 < sum(keep) < len(keep)
    # the loss: the surrogate weighed by min(e^d, cap) keep
    ratio = torch.exp((trainer - sampler) * mask)
    weights = torch.clamp(ratio, max=1e-2) * mask * batch.extras[KEEP][:, None]
    out = objective.loss(model, batch)
    per_token, _ = per_token_loss(logps, trainer, None, batch.extras["advantages"], mask, objective.settings,
                                  weights)
    assert torch.equal(out.sum, reduce_loss(per_token, mask, objective.g.loss_norm))
    clipped = int(((ratio > 1e-2) & mask).sum())
    assert 0 < clipped < int(mask.sum())
    totals = {k: float(v) for k, v in {**out.metrics, **out.maxima}.items()}
    fields = objective.ledger_fields(batch, totals, 0)
    diff = ((trainer - sampler) * mask).abs()
    assert fields["rollout_logp_diff_mean"] == pytest.approx(float(diff.sum() / mask.sum()), rel=1e-6)
    assert fields["rollout_logp_diff_max"] == float(diff.max())
    assert fields[PARITY] == pytest.approx(float(diff.max()), abs=1e-5)  # still sampler against trainer
    assert fields["tis_clipped_fraction"] == pytest.approx(clipped / int(mask.sum()), abs=1e-12)
    assert fields["mis_masked_fraction"] == pytest.approx(1.0 - sum(keep) / len(keep), abs=1e-12)
    assert settings.mis == "geometric"


# ---------------------------------------------------------------- PPO's objective


def test_ppo_weighs_its_policy_loss_and_not_its_value_loss():
    from training.objectives.critic import build_critic
    from training.objectives.ppo import CRITIC, PPOObjective

    base = {"data": {"sources": [{"path": "datasets/tasks/rl/train", "record": "prompt"}], "num_streams": 4},
            "train": {"global_batch_size": 4, "micro_batch_size": 2}}

    def objective(ppo: dict) -> PPOObjective:
        config = config_lib.from_dict({**base, "objective": {"kind": "ppo", "ppo": ppo}})
        config_lib.validate(config)
        made = PPOObjective(config)
        made._context = SimpleNamespace(place=lambda tensor: tensor, faults=None)
        return made

    off = objective({})
    on = objective({"rollout_correction": {"tis_cap": 1.5, "mis": "product", "mis_high": 8.0}})
    model = models.build(off.config.model, generator=seeding.generator(3, "model_init"))
    critic = build_critic(off.config)
    ids = torch.arange(2, 14).reshape(2, 6)
    labels = torch.full((2, 6), IGNORE_INDEX)
    labels[:, 3:5] = ids[:, 4:6]
    mask = labels != IGNORE_INDEX
    old = torch.full((2, 6), -3.0) * mask
    # token ratios pi_train / pi_rollout: 2 on row 0, 4 on row 1; every weight is the cap 1.5, and MIS's
    # product ratios (2 x 2 = 4 and 4 x 4 = 16 against [0.5, 8]) keep row 0 and drop row 1
    rollout = old - torch.tensor([[math.log(2.0)], [math.log(4.0)]]) * mask
    keep = sequence_keep(old, rollout, mask, on.correction)
    assert keep.tolist() == [1.0, 0.0]
    extras = {"old_logps": old, "old_values": torch.zeros(2, 6), "returns": torch.ones(2, 6),
              "advantages": torch.tensor([[0.0, 0.0, 0.0, 1.0, -0.5, 0.0], [0.0, 0.0, 0.0, 2.0, 1.0, 0.0]])}
    batch = Batch(step=1, input_ids=ids, labels=labels, position_ids=torch.arange(6).expand(2, 6).clone(),
                  document_ids=torch.zeros(2, 6, dtype=torch.int64), sequence_index=[0, 1],
                  provenance=[[], []], state={}, extras=extras)
    parts = {CRITIC: critic}
    plain = off.loss(model, batch, parts)
    weighed = on.loss(model, batch.with_extras(**{ROLLOUT_LOGPS: rollout, KEEP: keep}), parts)
    row_0 = off.loss(model, batch.select([0]), parts)
    assert weighed.metrics["value_loss"] == plain.metrics["value_loss"]
    assert float(weighed.metrics["policy_loss"]) == pytest.approx(1.5 * float(row_0.metrics["policy_loss"]),
                                                                  rel=1e-6)
    assert float(row_0.metrics["policy_loss"]) != 0.0
    assert float(weighed.metrics[CLIPPED]) == 4.0 and float(weighed.metrics[MASKED]) == 1.0
    assert float(weighed.maxima[DIFF_MAX]) == pytest.approx(math.log(4.0), rel=1e-6)
    assert not {ABS_DIFF, TOKENS, CLIPPED, MASKED, ROWS} & set(plain.metrics) and not plain.maxima


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_tiny_grpo_with_both_corrections_writes_their_ledger_fields(e2e_workdir):
    from tests.methods import GRPO

    result = launch.train(e2e_workdir, ["--config", str(GRPO.config_path), "run.name=grpo-rollout-correction",
                                        "train.max_steps=2", f"{CORRECTION}.tis_cap=2.0", f"{CORRECTION}.mis=geometric"],
                          nproc=1, timeout=600)
    assert result.returncode == 0, result.stderr
    run_dir = result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir
    lines = launch.ledger(run_dir)
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        # the same kernels sample and train on the CPU: the mismatch is float rounding, nothing is
        # clipped at 2 nor masked outside [0.5, 2], and the loss trains as without the correction
        assert 0.0 <= line["rollout_logp_diff_mean"] <= line["rollout_logp_diff_max"] < 1e-4
        assert line["tis_clipped_fraction"] == 0.0 and line["mis_masked_fraction"] == 0.0
        assert line["logprob_parity"] < 1e-4 and math.isfinite(line["loss"])
        assert len(line["inner_losses"]) == 2  # e2e-grpo.yaml's two updates per rollout batch
