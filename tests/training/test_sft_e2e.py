"""Supervised fine-tuning end to end on 2 CPU ranks. The four guarantees (SIGKILL + resume with
``trained_tokens`` in the ledger, replay, 2 -> 1 rank resume keeping the batch hashes and the
trained-token counts, accumulation) are the ``sft`` row of tests/training/test_guarantees.py;
here, what is particular to SFT:

- only assistant answers train: far fewer trained tokens than tokens;
- evaluation on the held-out chat source is masked the same way, and falls;
- an exported SFT checkpoint gives transformers the same logits.
"""

from __future__ import annotations


import pytest

from tests import launch
from tests.methods import SFT

pytestmark = pytest.mark.slow

STEPS = SFT.steps
SFT_CONFIG = SFT.config_path


def sft_args(*, max_steps: int = STEPS, name: str = "sft", overrides=()) -> list[str]:
    return ["--config", str(SFT_CONFIG), f"run.name={name}", f"train.max_steps={max_steps}", *overrides]


def _run_dir(workdir, result):
    return result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


@pytest.fixture
def reference(reference_runs):
    return reference_runs.run(SFT)


def test_sft_ledger_records_trained_tokens(reference):
    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    for line in lines:
        # Only assistant answers train: far fewer targets than tokens.
        assert 0 < line["trained_tokens"] == line["target_tokens"] < line["tokens"] // 4
    assert lines[-1]["loss"] < lines[0]["loss"]
    kinds = [e["event"] for e in launch.events(reference)]
    assert kinds[-1] == "finished"


def test_sft_eval_loss_is_masked_and_falls(e2e_workdir):
    result = launch.train(e2e_workdir, sft_args(max_steps=12, name="sft-eval", overrides=[
        "train.eval_interval=4", "train.eval_batches=2", "train.lr=3e-3"]), nproc=2)
    assert result.returncode == 0, result.stderr
    evals = [e for e in launch.events(_run_dir(e2e_workdir, result)) if e["event"] == "eval"]
    assert [e["step"] for e in evals] == [4, 8, 12]
    tokens = {e["tokens"] for e in evals}
    assert len(tokens) == 1 and 0 < tokens.pop() < 2 * 8 * 256 // 4  # only assistant tokens count
    assert evals[-1]["loss"] < evals[0]["loss"]


def test_sft_checkpoint_exports_with_transformers_logit_parity(e2e_workdir, reference, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from core import config as config_lib
    from core.layout import RunPaths
    from training.checkpoint.load import checkpoint_dir, load_checkpoint_model

    out = tmp_path / "hf"
    result = launch.run_module(e2e_workdir, ["training", "export", "--run", reference.name, "--to", str(out)])
    assert result.returncode == 0, result.stderr
    paths = RunPaths(reference)
    ours = load_checkpoint_model(config_lib.load(paths.config), checkpoint_dir(paths, None)).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 258, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= 1e-5
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# 2 ranks x 128 tokens x 65 values gathered, under the dense 512 x 64: the gathered path.
SMALL_STEP = ["parallel.strategy=ddp", "data.seq_len=128", "train.global_batch_size=2", "train.micro_batch_size=1",
              "data.num_streams=2"]


def test_sft_gathered_embedding_grad_matches_dense(e2e_workdir):
    """parallel.ddp_embedding_grad=gathered (docs/parallelism.md) on SFT's masked chat batches."""
    launch.gathered_embedding_grad_matches_dense(e2e_workdir, lambda how: sft_args(
        max_steps=3, name=f"sft-embedding-{how}", overrides=[*SMALL_STEP, f"parallel.ddp_embedding_grad={how}"]))
