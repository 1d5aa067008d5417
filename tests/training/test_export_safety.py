"""``python -m training export`` never destroys, and its directories behave like Qwen's in
``transformers`` and ``peft`` (training/cli/export_target.py, training/cli/export.py).

One LoRA SFT run (1 step, one process) whose ``model.init_from`` is a *relative* base path is
trained once; the exports run in-process from the run's working directory, except the kill -9
tests, which SIGKILL a subprocess at a known point through the export's test hook.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import models
from core import config as config_lib
from core.layout import RunPaths
from tests import launch
from training.__main__ import main
from training.checkpoint.manifest import CheckpointManifest, hash_file, read_manifest
from training.cli.export_target import EXPORT_MARKER, KILL_AT_ENV

pytestmark = pytest.mark.slow

LORA_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-lora.yaml"
BASE = "export-safety-base"  # relative to the run's working directory, as a user would write it


def _tree_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(directory)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def run(e2e_workdir):
    """(working directory, run dir) of a 1-step LoRA SFT run on the relative base ``BASE``."""
    model = models.build(config_lib.load(LORA_CONFIG).model, generator=torch.Generator().manual_seed(7))
    models.save_pretrained(model, e2e_workdir / BASE)
    result = launch.train(e2e_workdir, ["--config", str(LORA_CONFIG), "run.name=export-safety", "train.max_steps=1",
                                        "parallel.strategy=none", "checkpoint.at_end=true", f"model.init_from={BASE}"],
                          nproc=1)
    assert result.returncode == 0, result.stderr
    run_dir = result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir
    return e2e_workdir, run_dir


@pytest.fixture
def export(run, monkeypatch, capsys):
    """``export(*args)`` -> (exit code, stderr) of ``python -m training export --run <run> ...`` in-process."""
    workdir, run_dir = run
    monkeypatch.chdir(workdir)

    def call(*args: str, run_dir: Path = run_dir) -> tuple[int, str]:
        capsys.readouterr()
        code = main(["export", "--run", str(run_dir), *args])
        return code, capsys.readouterr().err.strip()

    return call


def _one_line(err: str) -> None:
    assert err and "\n" not in err and "Traceback" not in err, err


# --------------------------------------------------------------------------- refusals


def test_a_non_empty_target_is_replaced_only_with_overwrite(export, tmp_path):
    out = tmp_path / "merged"
    assert export("--to", str(out))[0] == 0
    assert "model.safetensors" in json.loads((out / EXPORT_MARKER).read_text())["files"]
    (out / "stray.txt").write_text("not written by the export")
    code, err = export("--to", str(out))
    assert code == 2 and "not empty" in err and "--overwrite" in err
    _one_line(err)
    code, err = export("--to", str(out), "--overwrite")  # what the export did not write would be lost
    assert code == 2 and "did not write (stray.txt)" in err and (out / "stray.txt").is_file()
    _one_line(err)
    (out / "stray.txt").unlink()
    (out / "model.safetensors").write_bytes(b"changed")
    assert export("--to", str(out), "--overwrite")[0] == 0  # an earlier export: replaced as a whole
    assert (out / "model.safetensors").read_bytes() != b"changed"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    code, err = export("--to", str(notes), "--overwrite")
    assert code == 2 and "not a Lockstep export" in err and (notes / "todo.txt").read_text() == "mine"


def test_overwrite_never_deletes_a_directory_that_merely_holds_a_config_json(export, run, tmp_path):
    """The probe: --overwrite deleted a directory with a config.json, nested run directories and all."""
    _, run_dir = run
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text("{}")
    shutil.copytree(run_dir, project / "runs" / run_dir.name)
    before = _tree_digest(project)
    code, err = export("--to", str(project), "--overwrite")
    assert code == 2 and f"--to {project} is not a Lockstep export" in err
    _one_line(err)
    assert _tree_digest(project) == before


def test_a_directory_a_known_run_uses_is_never_replaced(export, run):
    workdir, run_dir = run
    before = _tree_digest(workdir / BASE)
    code, err = export("--to", BASE, "--overwrite")
    assert code == 2 and run_dir.name in err and "model.init_from" in err
    _one_line(err)
    code, err = export("--to", str((workdir / BASE).resolve()), "--overwrite", "--adapter")  # any spelling
    assert code == 2 and run_dir.name in err
    assert _tree_digest(workdir / BASE) == before


def test_targets_inside_a_run_directory_are_refused(export, run):
    _, run_dir = run
    copied = run_dir / "artifacts" / "init_from"
    assert (copied / "config.json").is_file()  # the run's copy of its base config, which its exports read
    before = _tree_digest(run_dir / "artifacts")
    for target in (copied, run_dir / "exports" / "new"):
        code, err = export("--to", str(target), "--overwrite")
        assert code == 2 and f"inside the run directory {run_dir.resolve()}" in err
        _one_line(err)
    assert not (run_dir / "exports").exists() and _tree_digest(run_dir / "artifacts") == before


def test_links_and_files_are_refused_and_nothing_is_written_through_a_link(export, tmp_path):
    real = tmp_path / "real"
    assert export("--to", str(real))[0] == 0
    before = _tree_digest(real)
    link = tmp_path / "link"
    link.symlink_to(real)
    code, err = export("--to", str(link), "--overwrite")
    assert code == 2 and "symbolic link" in err
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    code, err = export("--to", str(a_file))
    assert code == 2 and "is a file" in err and a_file.read_bytes() == b"x"
    _one_line(err)
    # a weight file that is a link to something outside: overwriting replaces the link, never its target
    outside = tmp_path / "outside.safetensors"
    shutil.move(real / "model.safetensors", outside)
    (real / "model.safetensors").symlink_to(outside)
    outside_bytes = outside.read_bytes()
    assert export("--to", str(real), "--overwrite")[0] == 0
    assert outside.read_bytes() == outside_bytes and not (real / "model.safetensors").is_symlink()
    assert _tree_digest(real) == before


# --------------------------------------------------------------------------- atomicity


@pytest.mark.parametrize("point", ["weights", "staged", "published"])
def test_kill_9_during_a_re_export_leaves_a_whole_directory(run, export, tmp_path, point):
    """SIGKILL (the export's test hook) with the new weights half-written, with the new directory
    complete but not yet in place, and right after the swap: the target is always one whole
    directory, the previous one until the swap."""
    workdir, run_dir = run
    out = tmp_path / "model"
    assert export("--to", str(out))[0] == 0
    previous = _tree_digest(out)
    proc = subprocess.run([launch.PYTHON, "-m", "training", "export", "--run", str(run_dir), "--to", str(out),
                           "--overwrite", "--dtype", "bf16"], cwd=workdir, capture_output=True, text=True,
                          env={**launch.env(workdir), KILL_AT_ENV: point}, timeout=300)
    assert proc.returncode == -9, proc.stderr
    if point == "published":
        exported = json.loads((out / "config.json").read_text())
        assert exported["torch_dtype"] == exported["dtype"] == "bfloat16"
        assert (out / "tokenizer_config.json").is_file() and (out / "generation_config.json").is_file()
    else:
        assert _tree_digest(out) == previous
    assert export("--to", str(out), "--overwrite")[0] == 0  # the next export removes the dead one's leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_previous_directory_left_aside_by_a_two_rename_publish_is_restored(export, tmp_path, monkeypatch):
    """Where the kernel cannot exchange two directories, a kill between the two renames leaves the
    previous directory beside the target; the next export puts it back before judging the target."""
    import training.cli.export_target as export_target

    monkeypatch.setattr(export_target, "_exchange", lambda a, b: False)
    out = tmp_path / "model"
    assert export("--to", str(out))[0] == 0
    assert export("--to", str(out), "--overwrite")[0] == 0  # the two-rename path, completed
    previous = _tree_digest(out)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    aside = tmp_path / f".model.previous-{int(dead.stdout)}"
    out.rename(aside)  # as a kill after the first rename leaves it
    code, err = export("--to", str(out))
    assert code == 2 and "not empty" in err  # restored, so protected like any existing directory
    assert not aside.exists() and _tree_digest(out) == previous


# --------------------------------------------------------------------------- transformers / peft


def _forced_generate(model, tok, script: str, **kwargs):
    """Greedy ``generate`` whose every step is forced to the next token of ``script``: what stops it
    is only the export's generation config / tokenizer."""
    from transformers import LogitsProcessor, LogitsProcessorList

    ids = tok.encode(script, add_special_tokens=False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    inputs = torch.tensor([tok.encode(prompt, add_special_tokens=False)])

    class Script(LogitsProcessor):
        def __call__(self, input_ids, scores):
            i = input_ids.shape[1] - inputs.shape[1]
            forced = torch.full_like(scores, -1e9)
            forced[:, ids[i] if i < len(ids) else ids[-1]] = 0.0
            return forced

    out = model.generate(inputs, max_new_tokens=len(ids) + 4, do_sample=False,
                         logits_processor=LogitsProcessorList([Script()]), **kwargs)
    return tok.decode(out[0, inputs.shape[1]:])


def test_a_chat_export_stops_at_im_end_in_transformers(export, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "chat"
    assert export("--to", str(out), "--merge")[0] == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert model.generation_config.stop_strings == ["<|im_end|>"]  # several byte tokens: a stop string
    assert _forced_generate(model, tokenizer, "ok<|im_end|>and more", tokenizer=tokenizer) == "ok<|im_end|>"
    with pytest.raises(ValueError, match="tokenizer"):  # transformers needs it for stop strings (documented)
        _forced_generate(model, tokenizer, "ok<|im_end|>and more")
    model.generation_config.stop_strings = None  # without what the export wrote, it runs on
    assert _forced_generate(model, tokenizer, "ok<|im_end|>and more").startswith("ok<|im_end|>and more")


@pytest.fixture(scope="module")
def qwen_workdir(tmp_path_factory):
    """A working directory holding the Qwen vocabulary (datasets/tokenizers/qwen), built here in
    process, so that a fresh clone needs no `python -m data prepare --tokenizer qwen` first."""
    from data.__main__ import main as data_main

    root = tmp_path_factory.mktemp("qwen-vocab")
    assert data_main(["prepare", "--tokenizer", "qwen", "--out", str(root / "datasets" / "tokenizers" / "qwen")]) == 0
    return root


def test_qwen_tokenizer_chat_export_ends_turns_like_qwen_instruct(tmp_path, qwen_workdir, monkeypatch):
    """With the Qwen tokenizer ``<|im_end|>`` is one token: it becomes the eos, as in Qwen's instruct
    checkpoints, and ``generate`` stops there without being given the tokenizer."""
    transformers = pytest.importorskip("transformers")
    from training.cli.export import _write_tokenizer

    monkeypatch.chdir(qwen_workdir)

    config = config_lib.load(launch.ROOT / "tests" / "configs" / "e2e-sft.yaml",
                             ["data.tokenizer=qwen", "model.vocab_size=151936"])
    out = tmp_path / "qwen-chat"
    models.save_pretrained(models.build(config.model, generator=torch.Generator().manual_seed(0)), out)
    _write_tokenizer(config, RunPaths(tmp_path / "run"), out)
    generation = json.loads((out / "generation_config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    im_end, end_of_text = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert generation["eos_token_id"] == [im_end, end_of_text] and generation["pad_token_id"] == end_of_text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert _forced_generate(model, tokenizer, "ok<|im_end|>and more") == "ok<|im_end|>"


def test_pretraining_export_keeps_end_of_text_as_eos(tmp_path, qwen_workdir, monkeypatch):
    from training.cli.export import _write_tokenizer

    monkeypatch.chdir(qwen_workdir)

    config = config_lib.load(launch.ROOT / "tests" / "configs" / "e2e.yaml",
                             ["data.tokenizer=qwen", "model.vocab_size=151936"])
    _write_tokenizer(config, RunPaths(tmp_path / "run"), tmp_path)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 151643 and "stop_strings" not in generation
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"


def test_an_adapter_export_loads_with_auto_peft_from_another_directory(export, run, tmp_path, monkeypatch):
    peft = pytest.importorskip("peft")
    from training.checkpoint.load import checkpoint_dir, load_checkpoint_model

    workdir, run_dir = run
    adapter = tmp_path / "adapter"
    assert export("--to", str(adapter), "--adapter")[0] == 0
    recorded = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str((workdir / BASE).resolve())  # the run named it relatively
    config = config_lib.load(RunPaths(run_dir).config)
    ours = load_checkpoint_model(config, checkpoint_dir(RunPaths(run_dir), None)).eval()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32).eval()
    ids = torch.randint(0, 258, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - theirs(input_ids=ids).logits).abs().max().item() <= 1e-5


def test_a_base_from_the_hub_cache_is_named_by_its_id(run, tmp_path):
    import dataclasses

    from training.cli.export import peft_base_reference

    _, run_dir = run
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    config = config_lib.load(RunPaths(run_dir).config)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, init_from=str(snapshot)))
    assert peft_base_reference(RunPaths(run_dir), config) == "Qwen/Qwen2.5-0.5B-Instruct"


# --------------------------------------------------------------------------- one-line messages


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_dcp_pickle_is_refused_without_a_misleading_hint(export, run, tmp_path):
    _, run_dir = run
    copy = tmp_path / run_dir.name
    shutil.copytree(run_dir, copy)
    [ckpt] = sorted((copy / "checkpoints").glob("step_*"))
    marker = tmp_path / "pwned"
    meta = ckpt / "dcp" / ".metadata"
    meta.write_bytes(pickle.dumps(_Payload(marker)))
    manifest = read_manifest(ckpt)  # recomputed, as an attacker would
    forged = CheckpointManifest(step=manifest.step, world_size=manifest.world_size,
                                has_optimizer_state=manifest.has_optimizer_state,
                                torch_version=manifest.torch_version,
                                files={**manifest.files, "dcp/.metadata": hash_file(meta)})
    (ckpt / "manifest.json").write_bytes(forged.to_bytes())
    code, err = export("--to", str(tmp_path / "out"), run_dir=copy)
    assert code == 4 and "refusing to load it" in err and "architecture" not in err
    _one_line(err)
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_damaged_base_safetensors_is_one_line(export, run, tmp_path, monkeypatch):
    workdir, run_dir = run
    shutil.copytree(workdir / BASE, tmp_path / BASE)
    weights = tmp_path / BASE / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    monkeypatch.chdir(tmp_path)  # where the run's relative base now names the damaged copy
    code, err = export("--to", str(tmp_path / "out"))
    assert code == 2 and "model.safetensors" in err and "not a readable safetensors file" in err
    _one_line(err)


def test_a_full_disk_is_one_line_and_leaves_the_previous_directory(export, tmp_path, monkeypatch):
    import models.hf_weights as hf_weights
    import training.cli.export_target as export_target

    out = tmp_path / "model"
    assert export("--to", str(out))[0] == 0
    previous = _tree_digest(out)
    usage = shutil.disk_usage(tmp_path)
    with monkeypatch.context() as patch:  # the free-space check, before anything is written
        patch.setattr(export_target.shutil, "disk_usage", lambda path: usage._replace(free=1024))
        code, err = export("--to", str(out), "--overwrite")
    assert code == 4 and "not enough free disk space" in err
    _one_line(err)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(hf_weights, "save_file", full)  # the disk fills up while the weights are written
    code, err = export("--to", str(out), "--overwrite")
    assert code == 4 and "disk filled up" in err
    _one_line(err)
    assert _tree_digest(out) == previous and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
