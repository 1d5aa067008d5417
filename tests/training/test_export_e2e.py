"""``python -m training export`` from checkpoints of other strategies and of init_from runs.

- a 2-rank FSDP checkpoint exports to a directory that transformers loads with the same
  logits (fp32, within 1e-5) as Lockstep's model from that checkpoint;
- a run started ``model.init_from`` a Hugging Face directory exports that directory's own
  config.json (fields Lockstep does not model survive), with the tokenizer it was loaded with;
- ``generate --from`` an export renders a text prompt as its run would: raw for a pretraining run's,
  through the chat template for an SFT run's (the export's marker records which).
"""

from __future__ import annotations

import json

import pytest
import torch

from core import config as config_lib
from core.layout import RunPaths
from tests import launch
from tests.e2e_config import e2e_args
from training.__main__ import main
from training.checkpoint.load import checkpoint_dir, load_checkpoint_model
from training.cli.export_target import EXPORT_MARKER

pytestmark = pytest.mark.slow


def _run_dir(workdir, result):
    return result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


def _logits_parity(run_dir, out):
    transformers = pytest.importorskip("transformers")
    paths = RunPaths(run_dir)
    ours = load_checkpoint_model(config_lib.load(paths.config), checkpoint_dir(paths, None)).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return (ours(ids) - theirs(ids).logits).abs().max().item()


def test_fsdp_checkpoint_exports_with_logit_parity(e2e_workdir, tmp_path):
    result = launch.train(e2e_workdir, e2e_args(max_steps=2, name="fsdp-export",
                                                overrides=["parallel.strategy=fsdp"]), nproc=2)
    assert result.returncode == 0, result.stderr
    run_dir = _run_dir(e2e_workdir, result)
    out = tmp_path / "hf"
    exported = launch.run_module(e2e_workdir, ["training", "export", "--run", run_dir.name, "--to", str(out)])
    assert exported.returncode == 0, exported.stderr
    assert _logits_parity(run_dir, out) <= 1e-5


@pytest.fixture(scope="module")
def pretrained_then_sft(e2e_workdir, tmp_path_factory):
    """(source, raw, SFT run dir, out): a 1-step pretraining run exported to ``source``, whose config.json
    then gains fields Lockstep does not model (``raw``), and a 2-step SFT run from it exported to ``out``."""
    tmp_path = tmp_path_factory.mktemp("export-chain")
    base = launch.train(e2e_workdir, e2e_args(max_steps=1, name="init-base", overrides=["parallel.strategy=none"]),
                        nproc=1)
    assert base.returncode == 0, base.stderr
    source = tmp_path / "source"
    first = launch.run_module(e2e_workdir, ["training", "export", "--run", _run_dir(e2e_workdir, base).name,
                                            "--to", str(source)])
    assert first.returncode == 0, first.stderr
    raw = json.loads((source / "config.json").read_text())
    raw.update({"bos_token_id": 256, "eos_token_id": 256, "use_sliding_window": False, "max_window_layers": 2})
    (source / "config.json").write_text(json.dumps(raw))
    sft = launch.train(e2e_workdir, ["--config", str(launch.ROOT / "tests" / "configs" / "e2e-sft.yaml"),
                                     "run.name=init-sft", "train.max_steps=2", "parallel.strategy=none",
                                     f"model.init_from={source}"], nproc=1)
    assert sft.returncode == 0, sft.stderr
    run_dir = _run_dir(e2e_workdir, sft)
    out = tmp_path / "again"
    second = launch.run_module(e2e_workdir, ["training", "export", "--run", run_dir.name, "--to", str(out)])
    assert second.returncode == 0, second.stderr
    return source, raw, run_dir, out


def test_an_init_from_run_exports_the_source_architecture_fields(pretrained_then_sft):
    source, raw, run_dir, out = pretrained_then_sft
    exported = json.loads((out / "config.json").read_text())
    assert {k: v for k, v in exported.items() if k != "torch_dtype"} == \
        {k: v for k, v in raw.items() if k != "torch_dtype"}
    assert (out / "tokenizer.json").is_file() and "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    assert _logits_parity(run_dir, out) <= 1e-5


def _generated_prompt(directory, tmp_path, *flags: str) -> str:
    out = tmp_path / f"generated-{len(list(tmp_path.iterdir()))}.jsonl"
    code = main(["generate", "--from", str(directory), "--device", "cpu", "--prompt", "Hi",
                 "--max-new-tokens", "2", "--out", str(out), *flags])
    assert code == 0
    return json.loads(out.read_text().splitlines()[0])["prompt"]


def test_an_export_generates_as_its_run_does_by_default(pretrained_then_sft, tmp_path):
    """Both exports hold the chat template; the marker says which one is a chat model."""
    source, _, _, out = pretrained_then_sft
    templated = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert "chat_template" in json.loads((source / "tokenizer_config.json").read_text())
    assert json.loads((source / EXPORT_MARKER).read_text())["chat_model"] is False
    assert json.loads((out / EXPORT_MARKER).read_text())["chat_model"] is True
    assert _generated_prompt(source, tmp_path) == "Hi"  # causal_lm: raw, as its run generates
    assert _generated_prompt(out, tmp_path) == templated  # sft: through the template
    assert _generated_prompt(source, tmp_path, "--chat") == templated  # the flags still decide
    assert _generated_prompt(out, tmp_path, "--no-chat") == "Hi"


def test_an_init_from_run_exports_from_any_directory_after_its_source_moved(pretrained_then_sft, tmp_path):
    """The shape of a run started ``model.init_from`` a directory comes from the run's own copy of
    that directory's config.json (artifacts/init_from/): an export from another working directory,
    where a relative ``init_from`` names nothing, or after the directory moved, still loads."""
    source, raw, run_dir, _ = pretrained_then_sft
    moved = source.with_name("source-moved")
    source.rename(moved)
    try:
        out = tmp_path / "from-elsewhere"
        done = launch.run_module(tmp_path, ["training", "export", "--run", str(run_dir), "--to", str(out)])
        assert done.returncode == 0, done.stderr
        exported = json.loads((out / "config.json").read_text())
        assert {k: v for k, v in exported.items() if k != "torch_dtype"} == \
            {k: v for k, v in raw.items() if k != "torch_dtype"}
    finally:
        moved.rename(source)


def test_an_export_records_template_thinking_and_generates_as_its_run_did(e2e_workdir, tmp_path):
    """A run rendering with Qwen3's template and ``data.template_thinking=false``: its export's marker
    records the setting, and ``generate`` from the export renders the empty think block the run's
    prompts had, as ``generate`` from the run itself does."""
    sft = launch.train(e2e_workdir, ["--config", str(launch.ROOT / "tests" / "configs" / "e2e-sft.yaml"),
                                     "run.name=no-thinking", "train.max_steps=1", "parallel.strategy=none",
                                     "data.chat_template=qwen3", "data.template_thinking=false"], nproc=1)
    assert sft.returncode == 0, sft.stderr
    run_dir = _run_dir(e2e_workdir, sft)
    out = tmp_path / "no-thinking"
    done = launch.run_module(e2e_workdir, ["training", "export", "--run", run_dir.name, "--to", str(out)])
    assert done.returncode == 0, done.stderr
    assert json.loads((out / EXPORT_MARKER).read_text())["template_thinking"] is False
    expected = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert _generated_prompt(out, tmp_path) == expected == _generated_prompt(run_dir, tmp_path)
