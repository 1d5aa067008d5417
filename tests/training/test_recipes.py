"""The recipes for real Qwen checkpoints (configs/qwen*-sft.yaml, -dpo, -grpo, -rm, -ppo).

Each loads; its batch and streams divide over 1 and 8 ranks (with the override its header names
for eight, where one is needed); it takes its tokenizer from ``model.init_from``; the shapes of
scripts/random_checkpoint.py are the presets'. And, slow: each trains 2 steps on CPU at a tiny
shape of its family, from a checkpoint written by scripts/random_checkpoint.py (transformers'
``save_pretrained`` with the Qwen tokenizer), as the recipe's command runs it on a GPU.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import pytest
import yaml

from core.batch_shape import batch_shape_violations
from core.config import load, validate
from tests import launch

CONFIGS = launch.ROOT / "configs"


def _random_checkpoint():
    """scripts/random_checkpoint.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("random_checkpoint", launch.ROOT / "scripts" / "random_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Recipe:
    arch: str
    """scripts/random_checkpoint.py's --arch of the model the recipe is for."""
    template: str
    """Its data.chat_template."""
    eight: tuple[str, ...] = ()
    """What its header adds for eight GPUs."""
    cpu: tuple[str, ...] = ()
    """What its tiny CPU run changes beyond the shared shrinking (SHRINK)."""


RECIPES = {
    "qwen3-0.6b-sft": Recipe("qwen3-0.6b", "qwen3"),
    "qwen2.5-0.5b-lora-sft": Recipe("qwen2.5-0.5b", "qwen2.5"),
    "qwen3-1.7b-qlora-sft": Recipe("qwen3-1.7b", "qwen3", eight=("parallel.strategy=fsdp",)),
    "qwen3-0.6b-dpo": Recipe("qwen3-0.6b", "qwen3"),
    "qwen3-0.6b-grpo": Recipe("qwen3-0.6b", "qwen3", cpu=(
        "objective.grpo.group_size=2", "objective.grpo.max_new_tokens=4")),
    "qwen3-0.6b-rm": Recipe("qwen3-0.6b", "qwen3"),
    "qwen3-0.6b-ppo": Recipe("qwen3-0.6b", "qwen3", cpu=(
        "objective.ppo.group_size=2", "objective.ppo.max_new_tokens=4")),
}

# What shrinks a recipe to a 2-step CPU run: one process, fp32, no compile, 2 rows of 64 tokens a
# step in 2 micro-batches of one (2 streams; a row costs about 1 CPU-s, the head over the Qwen
# vocabulary), no evaluation, no TensorBoard; the checkpoint at the end stays.
SHRINK = ("parallel.device=cpu", "parallel.precision=fp32", "parallel.compile=false", "data.seq_len=64",
          "data.num_streams=2", "data.workers=0", "train.max_steps=2", "train.global_batch_size=2",
          "train.micro_batch_size=1", "train.warmup_steps=1", "train.eval_interval=0",
          "checkpoint.async_save=false", "metrics.tensorboard=false")


def test_every_recipe_is_listed():
    """A new recipe config gets a row above (and so these checks)."""
    found = {p.stem for p in CONFIGS.glob("qwen*.yaml") if p.stem.endswith(("-sft", "-dpo", "-grpo", "-rm", "-ppo"))}
    assert found == set(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_loads_and_divides_over_one_and_eight_ranks(name):
    recipe = RECIPES[name]
    one = load(CONFIGS / f"{name}.yaml")
    validate(one, world_size=1)
    eight = load(CONFIGS / f"{name}.yaml", list(recipe.eight))
    validate(eight, world_size=8)
    # What `python train.py --nproc N` checks before it starts a rank.
    assert batch_shape_violations(one, 1) == [] and batch_shape_violations(eight, 8) == []
    assert eight.parallel.strategy == "fsdp" and one.parallel.precision == "bf16"
    assert one.data.chat_template == recipe.template
    assert all(s.path.startswith("datasets/tasks/") for s in (*one.data.sources, one.data.eval_source))
    if one.model.quantize_base == "nf4":
        from models.nf4 import check_nf4_layout

        check_nf4_layout(one.model, shards=1)
        check_nf4_layout(eight.model, shards=8)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_takes_the_tokenizer_of_init_from(name, tmp_path):
    """No data.tokenizer anywhere in the recipe: the Hugging Face directory's is the run's."""
    (tmp_path / "tokenizer.json").write_text("{}")
    assert load(CONFIGS / f"{name}.yaml", [f"model.init_from={tmp_path}"]).data.tokenizer == str(tmp_path)


CHECKPOINT_TO_MODEL = {
    "hidden_size": "hidden_size", "intermediate_size": "intermediate_size", "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "vocab_size": "vocab_size",
    "tie_word_embeddings": "tie_embeddings", "max_position_embeddings": "max_position_embeddings",
    "rope_theta": "rope_theta", "rms_norm_eps": "rms_norm_eps",
}


@pytest.mark.parametrize("arch", ["qwen3-0.6b", "qwen2.5-0.5b", "qwen3-1.7b"])
def test_random_checkpoint_shapes_are_the_presets_and_the_recipes(arch):
    _, values = _random_checkpoint().ARCHS[arch]
    sections = [yaml.safe_load((CONFIGS / f"{arch}.yaml").read_text())["model"]]
    sections += [yaml.safe_load((CONFIGS / f"{name}.yaml").read_text()).get("model")
                 for name, recipe in RECIPES.items() if recipe.arch == arch]
    for model in filter(None, sections):
        for ours, theirs in CHECKPOINT_TO_MODEL.items():
            assert values[ours] == model[theirs], (arch, ours)
        assert values.get("head_dim", values["hidden_size"] // values["num_attention_heads"]) == model["head_dim"]


@pytest.fixture(scope="module")
def recipe_workdir(tmp_path_factory, qwen_vocabulary):
    """The embedded tasks, small (8 shards: one unit per stream), and one tiny checkpoint of each
    arch written by scripts/random_checkpoint.py (its TINY shapes) with the Qwen tokenizer."""
    from data.tasks import write_task_datasets

    root = tmp_path_factory.mktemp("recipes")
    write_task_datasets(root / "datasets" / "tasks", seed=0, train_n=256, eval_n=16, shards=8)
    script = _random_checkpoint()
    for arch, shape in script.TINY.items():
        script.write_checkpoint(arch, root / "weights" / arch, tokenizer=qwen_vocabulary, seed=0, dtype="fp32",
                                shape=shape)
    return root


@pytest.mark.slow
def test_every_recipe_trains_two_steps_at_a_tiny_shape_on_cpu(recipe_workdir):
    names = sorted(RECIPES)
    runs = [["--config", str(CONFIGS / f"{name}.yaml"), f"model.init_from=weights/{RECIPES[name].arch}",
             *SHRINK, *RECIPES[name].cpu] for name in names]
    results = launch.train_in_turn(recipe_workdir, runs, timeout=120)
    failed = {name: r.stderr[-2000:] for name, r in zip(names, results) if r.returncode != 0}
    assert not failed, failed
    for name, result in zip(names, results):
        run_dir = recipe_workdir / result.run_dir
        assert [line["step"] for line in launch.ledger(run_dir)] == [1, 2], name
        recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert recorded["data"]["tokenizer"] == f"weights/{RECIPES[name].arch}", name
        assert recorded["data"]["chat_template"] == RECIPES[name].template, name
