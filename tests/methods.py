"""The guarantee table: one row per training method (tests/guarantees.py says what a row holds
and what the four checks assert; tests/training/test_guarantees.py runs them on every row).

A new method is one more ``Method`` in ``METHODS``; its own e2e file (the row's ``e2e_file``)
then tests only what is particular to it, reading the row's uninterrupted run through the
``reference_runs`` fixture; ``make test`` runs that file and the row's checks on one worker
(``worker_group``), so that the run is trained once.

A row, in the order of its fields (``tests.guarantees.Method``; only ``name`` and ``config``
are required, a field left out is the common case):

    NAME = Method("name", "e2e-x.yaml",                 # row id (names its runs); tests/configs/ file
                  steps=8, overrides=(...),             # train.max_steps; dotted overrides of every run
                  entry="train.py",                     # the script the ranks run (a test kind: its own)
                  prepare=fn,                           # fn(workdir) -> overrides naming what it wrote
                  e2e_file="test_x_e2e.py",             # the method's own file in tests/training/
                  timeout_s=300, needs=("torchao",),    # per run; optional packages (else skipped)
                  kill=Kill(seed=7, ...), kill_overrides=fn,
                  replay_steps=(3, 6),                  # one before and one after a checkpoint
                  one_rank_step=4, one_rank_overrides=(...),   # resumable keys of the 1-rank resume
                  one_rank_same=(...), one_rank_close={...}, one_rank_loss_rel=1e-4,
                  samples_from_weights=False,           # GRPO/PPO: batches come from the weights
                  accumulation_steps=2, accumulation_loss_rel=1e-5,
                  accumulation_overrides=(...), accumulation_close={...})

then the row's name in ``METHODS`` (appended at the end), and a note below if it differs from the
defaults. tests/test_guarantee_table.py checks that its files exist and its steps reach past the
checkpoints its checks resume from.

Notes on the rows that differ from the defaults:

- LoRA's adapter dropout draws its masks keyed by data-parallel rank and micro-batch
  (models/lora.py): a 1-rank resume draws other masks after the checkpoint (losses within
  5e-3, measured under 1e-3; DPO's loss, read from small log-prob differences, within 1e-2,
  measured 6.3e-3), and the accumulation check turns dropout off.
- The FP8 head casts each chunk of a micro-batch's hidden states with its own scale (amax,
  training/linear_cross_entropy.py), so other micro-batch sizes round in FP8 differently: the
  accumulation check's losses agree within 1e-4 (measured 4.8e-5), not fp32 noise.
- GRPO samples its batches from the weights: after a 1-rank resume, or with another micro-batch
  size, the first step's rollouts and batch are the same, later ones come from weights that
  were reduced in another order (the same prompts); its first update's loss is near zero.
- QLoRA under FSDP is killed at a known point (step 5's data stalled), once.
- Agent GRPO (tests/configs/e2e-agent-grpo.yaml) plays episodes of several turns with a test
  environment that answers every turn (tests/agent_environment.py): kills land mid-episode, the
  ledger's ``episodes_hash`` is compared with the rest, and a replay appends the recorded
  observations (its e2e file replays with the environment made to fail if called).
- PPO samples from the weights as GRPO does (rollouts, old log-probs and values, advantages).
  Each step is four updates (two epochs of two minibatches), so 4 steps with a checkpoint every
  2 give the kills, replays and the 1-rank resume what they need; its accumulation check runs
  one step.
- Agent PPO (tests/configs/e2e-agent-ppo.yaml) plays agent GRPO's episodes with PPO's critic:
  its kill lands mid-episode, ``episodes_hash`` is compared with the rest; one epoch of two
  minibatches a step (kills between the updates of one step are the ppo row's), 3 steps with a
  checkpoint at 2; its e2e file replays step 2 with the environment made to fail if called, the
  row's replay step 3.
- GRPO and PPO with a reward model (``grpo-model-reward``, ``ppo-model-reward``) are those rows
  with a 4-step reward-model run as their second reward (tests/reward_models.py), which the row's
  ``prepare`` trains; the 1-rank resume and the accumulation check compare the rewards too
  (``reward_mean``, and the advantages in ``batch_hash``): a reward model's score depends on
  neither the world size nor the micro-batch size (training/objectives/model_reward.py).
- ``gelu-lm`` trains a model family the tests alone register (tests/families/gelu_lm.py: two
  stacks of LayerNorm + GELU blocks, learned positions), through its entry script
  (tests/families/gelu_lm_train.py). Its auxiliary loss and per-stack metrics are the ledger's
  ``model/*`` fields: bitwise under kill/resume and replay, sums in another order across ranks
  and micro-batch sizes (``one_rank_close``, ``accumulation_close``). 6 steps, a checkpoint every 3.
- ``moe`` pretrains a tiny Qwen3-MoE (tests/configs/e2e-moe.yaml: a dense layer, then 4 experts
  top-2) with the load-balancing loss and auxiliary-loss-free balancing on. Its ``model/*``
  fields (the auxiliary loss, the sparse layer's load min/max and router bias min/max) are bitwise
  under kill/resume and replay, and the router bias resumes from the checkpoint (a buffer). On 1
  rank the step's forwards are the same micro-batches, so the fields are sums in another order
  (``one_rank_close``). Under accumulation the bias fields stay (the bias moves by the step's
  integer tokens per expert, summed over micro-batches and ranks), and so does the balancing
  loss: its tokens per expert are the global batch's (training/step.py sums them over the step's
  micro-batches and the ranks before the first backward, models/forward.py's PooledProductLoss),
  so only its router-probability sums add in another order (within 1e-6). The load min/max are
  the extremes of one forward's tokens per expert, which a forward of one row and one of four do
  not share: the accumulation check leaves them out.
- ``moe-sft`` fine-tunes the moe row's model on the chat tasks (tests/configs/e2e-moe-sft.yaml)
  under FSDP with the experts split over the 2 ranks (``parallel.ep=2``): kill/resume and replay
  run at ep=2, the 1-rank resume continues the ep=2 checkpoint at ``parallel.ep=1``
  (``one_rank_overrides``: the experts are whole tensors in the checkpoint), and the accumulation
  check runs on one rank at ep=1. Its fields compare as the moe row's. 6 steps, a checkpoint every 3.
- ``moe-grpo`` runs GRPO on the moe row's model (tests/configs/e2e-moe-grpo.yaml, e2e-grpo.yaml's
  rollouts and rewards, two updates per step; the router bias moves after each) with routing replay
  on (the rollouts carry the sampler's expert choices, in the batch hash, and every update routes by
  them): as the grpo row, the 1-rank resume and the accumulation check compare the first step after
  their common start, the fields as the moe row's. 3 steps, a checkpoint at 2.
- ``vl-sft`` fine-tunes a tiny Qwen2.5-VL (tests/configs/e2e-vl-sft.yaml) on the image chats that
  ``python -m data prepare`` writes beside the photographs (data/kinds/image_chat.py): each image's
  patches are ``Batch.media``, in the row digests, so ``batch_hash`` (kill/resume, replay, the
  1-rank resume, accumulation) covers the pixels. 6 steps, a checkpoint every 3; its e2e file
  mirrors the photographs: the first batch's hash changes and a replay does not verify.
- ``vl-grpo`` runs GRPO on that model (tests/configs/e2e-vl-grpo.yaml) over the image prompts
  ``python -m data prepare`` writes (data/kinds/image_prompt.py): each prompt's image goes to the
  sampler's prefill (its rollouts) and, as ``Batch.media`` of its completion rows, to the update, so
  ``rollout_hash`` and ``batch_hash`` depend on the pixels. As the grpo row, the 1-rank resume and
  the accumulation check compare the first step after their common start. 3 steps, a checkpoint at 2.
"""

from __future__ import annotations

from pathlib import Path

from tests import launch
from tests.guarantees import CONFIGS, Kill, Method, run_dir
from tests.reward_models import with_model_reward

TEACHER = ("model.hidden_size=96", "model.intermediate_size=192", "model.num_layers=3", "parallel.strategy=none")


def train_teacher(workdir: Path, name: str, extra=()) -> Path:
    """A larger tiny model pretrained for 6 steps on one rank: a distillation teacher (``run:ID``)."""
    result = launch.train(workdir, ["--config", str(CONFIGS / "e2e.yaml"), f"run.name={name}", "train.max_steps=6",
                                    *TEACHER, *extra], nproc=1)
    assert result.returncode == 0, result.stderr
    return run_dir(workdir, result)


def save_base(config: str, path: Path, *, seed: int, nudge: float = 0.0) -> Path:
    """A Hugging Face directory of ``config``'s model shape from a seeded init (optionally with one
    weight nudged), without adapters or quantization: LoRA and QLoRA runs start from it."""
    import torch

    import models
    from core import config as config_lib

    model = models.build(config_lib.load(CONFIGS / config).model, generator=torch.Generator().manual_seed(seed))
    assert not any(name.endswith(".lora_A.weight") for name, _ in model.named_parameters())
    if nudge:
        with torch.no_grad():
            model.layers[0].mlp.up_proj.weight[0, 0] += nudge
    models.save_pretrained(model, path)
    return path


def _teacher(workdir: Path) -> tuple[str, ...]:
    return (f"objective.distill.teacher=run:{train_teacher(workdir, 'teacher').name}",)


def _base(config: str, directory: str, seed: int):
    def prepare(workdir: Path) -> tuple[str, ...]:
        return (f"model.init_from={save_base(config, workdir / directory, seed=seed)}",)
    return prepare


def _dpo_cache(directory: str):
    def overrides(workdir: Path) -> tuple[str, ...]:
        return (f"objective.dpo.cache_dir={workdir / directory}",)
    return overrides


# FSDP as the Qwen presets run it: gathered parameters kept until the backward, 2 blocks per unit.
QWEN_FSDP = ("parallel.strategy=fsdp", "parallel.reshard_after_forward=false", "parallel.fsdp_unit_blocks=2",
             "model.num_layers=4")
DPO_LORA = ("model.lora.rank=4", "model.lora.alpha=8.0", "model.lora.dropout=0.1", "train.lr=1.0e-2",
            "objective.dpo.reference=adapter_off", "parallel.strategy=fsdp", "parallel.activation_checkpointing=full")
HEAD_IN_FLOAT8 = ("parallel.float8_head=true", "parallel.strategy=fsdp", "checkpoint.interval=2")

PRETRAINING = Method("pretraining", "e2e.yaml", e2e_file="test_determinism_e2e.py", steps=12,
                     kill=Kill(seed=1234, kills=3), accumulation_steps=3,
                     accumulation_close={"grad_norm": (1e-4, 0.0)})
PRETRAINING_FSDP = Method("pretraining-fsdp", "e2e.yaml", overrides=QWEN_FSDP, kill=Kill(seed=5, kills=2),
                          replay_steps=(5,))
SFT = Method("sft", "e2e-sft.yaml", e2e_file="test_sft_e2e.py", kill=Kill(seed=99),
             one_rank_same=("batch_hash", "trained_tokens"), accumulation_overrides=("parallel.strategy=none",))
# The reference log-probs come from a cache the uninterrupted run fills; the killed run fills
# its own while it is killed (a torn last line is computed again on resume).
DPO = Method("dpo", "e2e-dpo.yaml", e2e_file="test_dpo_e2e.py",
             overrides=("train.eval_interval=8", "train.eval_batches=2", "objective.dpo.cache_reference=true"),
             prepare=_dpo_cache("dpo-reference-cache"), kill_overrides=_dpo_cache("dpo-killed-cache"),
             one_rank_same=("batch_hash", "pairs"), accumulation_overrides=("parallel.strategy=none",),
             accumulation_close={"rewards_margin": (1e-4, 1e-7)})
DPO_LORA_ADAPTER_OFF = Method("dpo-lora-adapter-off", "e2e-dpo.yaml", e2e_file="test_dpo_e2e.py", steps=6,
                              overrides=DPO_LORA, kill=Kill(seed=11), replay_steps=(6,),
                              one_rank_loss_rel=1e-2, accumulation_overrides=("model.lora.dropout=0.0",))
DISTILL = Method("distill", "e2e-distill.yaml", e2e_file="test_distill_e2e.py", prepare=_teacher, kill=Kill(seed=11),
                 accumulation_overrides=("parallel.strategy=none",))
LORA = Method("lora", "e2e-lora.yaml", e2e_file="test_lora_e2e.py", prepare=_base("e2e-lora.yaml", "lora-base", 7),
              one_rank_loss_rel=5e-3, accumulation_overrides=("model.lora.dropout=0.0",))
QLORA = Method("qlora", "e2e-qlora.yaml", e2e_file="test_qlora_e2e.py", needs=("torchao",),
               prepare=_base("e2e-qlora.yaml", "qlora-base", 11), kill=Kill(seed=11),
               one_rank_same=("batch_hash", "trained_tokens"))
QLORA_FSDP = Method("qlora-fsdp", "e2e-qlora-fsdp.yaml", e2e_file="test_qlora_e2e.py", steps=6, needs=("torchao",),
                    prepare=_base("e2e-qlora-fsdp.yaml", "qlora-fsdp-base", 11), kill=Kill(seed=0, stall=True),
                    replay_steps=(5,), one_rank_same=("batch_hash", "trained_tokens"))
GRPO = Method("grpo", "e2e-grpo.yaml", e2e_file="test_grpo_e2e.py", steps=5, timeout_s=600,
              kill=Kill(seed=7, steps=(1, 2), delay_s=1.0, wait_s=300, finish_s=600),  # most kills land mid-rollout
              replay_steps=(3,), one_rank_step=2, one_rank_same=("rollout_hash", "batch_hash", "reward_mean"),
              samples_from_weights=True, accumulation_steps=1, accumulation_close={"grad_norm": (1e-5, 0.0)})
AGENT_GRPO = Method("agent-grpo", "e2e-agent-grpo.yaml", e2e_file="test_agent_grpo_e2e.py", steps=4, timeout_s=600,
                    kill=Kill(seed=48, steps=(1, 2), delay_s=1.0, wait_s=300, finish_s=600),
                    replay_steps=(3,), one_rank_step=2,
                    one_rank_same=("rollout_hash", "episodes_hash", "batch_hash", "reward_mean"),
                    samples_from_weights=True, accumulation_steps=1, accumulation_close={"grad_norm": (1e-5, 0.0)})
FLOAT8_HEAD = Method("float8-head", "e2e.yaml", e2e_file="test_float8_head_e2e.py", steps=6, overrides=HEAD_IN_FLOAT8,
                     kill=Kill(seed=20), replay_steps=(3, 5), accumulation_loss_rel=1e-4)

PPO = Method("ppo", "e2e-ppo.yaml", e2e_file="test_ppo_e2e.py", steps=4, overrides=("checkpoint.interval=2",),
             timeout_s=600, kill=Kill(seed=47, delay_s=1.0, wait_s=300, finish_s=600),  # kills land mid-epoch
             replay_steps=(1, 3), one_rank_step=2,
             one_rank_same=("rollout_hash", "batch_hash", "reward_mean", "kl_coef", "kl", "explained_variance"),
             samples_from_weights=True, accumulation_steps=1,
             accumulation_close={"value_loss": (1e-4, 1e-6), "policy_loss": (1e-4, 1e-6), "kl": (1e-4, 1e-6)})

# PPO's episodes as agent GRPO's: one epoch of two minibatches, 3 steps with a checkpoint at 2.
AGENT_PPO = Method("agent-ppo", "e2e-agent-ppo.yaml", e2e_file="test_agent_ppo_e2e.py", steps=3, timeout_s=600,
                   kill=Kill(seed=48, steps=(1, 2), delay_s=1.0, wait_s=300, finish_s=600),
                   replay_steps=(3,), one_rank_step=2,
                   one_rank_same=("rollout_hash", "episodes_hash", "batch_hash", "reward_mean", "kl_coef", "kl",
                                  "explained_variance"),
                   samples_from_weights=True, accumulation_steps=1,
                   accumulation_close={"value_loss": (1e-4, 1e-6), "policy_loss": (1e-4, 1e-6), "kl": (1e-4, 1e-6)})

REWARD_MODEL = Method("reward-model", "e2e-rm.yaml", e2e_file="test_reward_model_e2e.py",
                      overrides=("train.eval_interval=8", "train.eval_batches=2"), kill=Kill(seed=47),
                      one_rank_same=("batch_hash", "pairs", "accuracy"), accumulation_overrides=("parallel.strategy=none",),
                      accumulation_close={"margin": (1e-4, 1e-7)})

# A test kind (tests/training/two_part_objective.py): the policy plus a value model, each its own
# trained part; its ranks run two_part_train.py, which registers the kind.
TWO_PART = Method("two-part", "e2e.yaml", entry="tests/training/two_part_train.py", e2e_file="test_two_part_e2e.py",
                  overrides=("objective.kind=two_part",), kill=Kill(seed=45),
                  one_rank_close={"value_loss": (1e-4, 1e-6), "grad_norm_value": (1e-3, 1e-6)})

# GRPO and PPO with a trained reward model as their second reward (tests/reward_models.py): GRPO's
# names the run, PPO's its export. Kills as their e2e files always made them; the 1-rank resume
# from the last checkpoint; PPO runs 6 steps (the critic test reads them) and replays one.
GRPO_MODEL_REWARD = with_model_reward(GRPO, kind="grpo", exported=False, e2e_file="test_grpo_model_reward_e2e.py",
                                      kill=Kill(seed=47), replay_steps=(2, 3), one_rank_step=4)
PPO_MODEL_REWARD = with_model_reward(PPO, kind="ppo", exported=True, e2e_file="test_ppo_model_reward_e2e.py",
                                     steps=6, kill=Kill(seed=47), replay_steps=(3,), one_rank_step=4)

# A model family the tests alone register (tests/families/gelu_lm.py); its ranks run
# gelu_lm_train.py, which registers it. Its model/* fields are sums over the batch.
GELU_LM_FIELDS = ("model/aux/hidden_square", "model/front_norm", "model/back_norm")
GELU_LM = Method("gelu-lm", "e2e-gelu-lm.yaml", entry="tests/families/gelu_lm_train.py", e2e_file="test_gelu_lm_e2e.py",
                 steps=6, kill=Kill(seed=64), replay_steps=(2, 5), one_rank_step=3,
                 one_rank_close={key: (1e-4, 1e-8) for key in GELU_LM_FIELDS},
                 accumulation_close={key: (1e-5, 1e-9) for key in GELU_LM_FIELDS})

# Qwen3-MoE pretraining (the model.arch qwen3_moe family) with both balancing methods on; the row's
# note says which model/* fields each check compares, and how closely.
MOE_SPARSE_LAYER = 1
MOE_LOAD_FIELDS = tuple(f"model/layer{MOE_SPARSE_LAYER}_load_{end}" for end in ("min", "max"))
MOE_BIAS_FIELDS = tuple(f"model/layer{MOE_SPARSE_LAYER}_bias_{end}" for end in ("min", "max"))
MOE_FIELDS = ("model/aux/load_balance", *MOE_LOAD_FIELDS, *MOE_BIAS_FIELDS)
MOE = Method("moe", "e2e-moe.yaml", e2e_file="test_moe_e2e.py", steps=6, kill=Kill(seed=67), replay_steps=(2, 5),
             one_rank_step=3, one_rank_close={key: (1e-5, 1e-8) for key in MOE_FIELDS},
             accumulation_close={"model/aux/load_balance": (1e-6, 1e-9),
                                 **{key: (1e-6, 1e-9) for key in MOE_BIAS_FIELDS}})

# Qwen3-MoE SFT and GRPO on the moe row's model: SFT with the experts split over the 2 ranks
# (parallel.ep=2; its 1-rank resume is an EP 2 -> 1 resume), GRPO at ep=1 with its rollouts
# sampled from the MoE policy. The row's note says what each check compares.
MOE_SFT = Method("moe-sft", "e2e-moe-sft.yaml", e2e_file="test_moe_sft_e2e.py", steps=6, kill=Kill(seed=71),
                 replay_steps=(2, 5), one_rank_step=3, one_rank_overrides=("parallel.ep=1",),
                 one_rank_same=("batch_hash", "trained_tokens"),
                 one_rank_close={key: (1e-5, 1e-8) for key in MOE_FIELDS},
                 accumulation_overrides=("parallel.strategy=none", "parallel.ep=1"),
                 accumulation_close={"model/aux/load_balance": (1e-6, 1e-9),
                                     **{key: (1e-6, 1e-9) for key in MOE_BIAS_FIELDS}})
MOE_GRPO = Method("moe-grpo", "e2e-moe-grpo.yaml", e2e_file="test_moe_grpo_e2e.py", steps=3, timeout_s=600,
                  kill=Kill(seed=72, steps=(1, 2), delay_s=1.0, wait_s=300, finish_s=600),
                  replay_steps=(3,), one_rank_step=2, one_rank_same=("rollout_hash", "batch_hash", "reward_mean"),
                  one_rank_close={key: (1e-5, 1e-8) for key in MOE_FIELDS},
                  samples_from_weights=True, accumulation_steps=1,
                  accumulation_close={"grad_norm": (1e-5, 0.0), "model/aux/load_balance": (1e-6, 1e-9),
                                      **{key: (1e-6, 1e-9) for key in MOE_BIAS_FIELDS}})

# Vision-language SFT (the model.arch qwen2_5_vl family) on the embedded image chats: images
# decoded in the data workers, carried as Batch.media and digested into batch_hash.
VL_SFT = Method("vl-sft", "e2e-vl-sft.yaml", e2e_file="test_vl_sft_e2e.py", steps=6, kill=Kill(seed=66),
                replay_steps=(2, 5), one_rank_step=3, one_rank_same=("batch_hash", "trained_tokens"),
                accumulation_overrides=("parallel.strategy=none",))

# Vision-language GRPO on the image prompts: rollouts sampled with each prompt's image, the update
# reading it again from the completion rows' media.
VL_GRPO = Method("vl-grpo", "e2e-vl-grpo.yaml", steps=3, timeout_s=600,
                 kill=Kill(seed=73, steps=(1, 2), delay_s=1.0, wait_s=300, finish_s=600),
                 replay_steps=(3,), one_rank_step=2, one_rank_same=("rollout_hash", "batch_hash", "reward_mean"),
                 samples_from_weights=True, accumulation_steps=1, accumulation_overrides=("parallel.strategy=none",),
                 accumulation_close={"grad_norm": (1e-5, 0.0)})

METHODS = (PRETRAINING, PRETRAINING_FSDP, SFT, DPO, DPO_LORA_ADAPTER_OFF, DISTILL, LORA, QLORA, QLORA_FSDP, GRPO,
           FLOAT8_HEAD, PPO, REWARD_MODEL, TWO_PART, AGENT_GRPO, AGENT_PPO, GRPO_MODEL_REWARD, PPO_MODEL_REWARD,
           GELU_LM, MOE, MOE_SFT, MOE_GRPO, VL_SFT, VL_GRPO)

TABLE = "tests/training/test_guarantees.py"
BY_NAME = {method.name: method for method in METHODS}


def worker_group(nodeid: str) -> str:
    """The group a test runs in under ``make test`` (tests/conftest.py): a row's checks and its
    method's e2e file (``e2e_file``) share one, so that the row's runs are trained once; any
    other test is grouped with its file, so that a file's module fixtures run once."""
    path, _, name = nodeid.partition("::")
    if path == TABLE and name.endswith("]"):
        method = BY_NAME[name[name.index("[") + 1:-1]]
        return f"tests/training/{method.e2e_file}" if method.e2e_file else method.name
    return path
