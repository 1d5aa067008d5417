"""The recipes for real Qwen checkpoints, proven at their real size without downloading weights.

    python benchmarks/recipes.py --out bench_out/recipes [--steps 20] [--recipes NAME,...] [--gpus 1] \
        [--work /tmp/lockstep-recipes] [--set KEY=VALUE ...] [--workdir DIR] [--tokenizer DIR] [--concurrent]
    python benchmarks/recipes.py --out bench_out/recipes-cpu --tiny --steps 4 --recipes qwen3-0.6b-sft   # CPU smoke

For every recipe (configs/qwen3-0.6b-sft.yaml, qwen2.5-0.5b-lora-sft, qwen3-1.7b-qlora-sft,
qwen3-0.6b-dpo, -grpo, -rm, -ppo; all by default), as its header's command runs it:

1. ``checkpoint``: scripts/random_checkpoint.py writes a random-init Hugging Face directory of the
   recipe's model (transformers' ``save_pretrained``, bf16, seed 0, the Qwen tokenizer), once per
   architecture, under ``--work``/weights.
2. ``reference``: ``python train.py [--nproc G] --config configs/RECIPE.yaml
   model.init_from=DIR train.max_steps=S checkpoint.interval=S/2 train.eval_interval=0`` runs S
   steps. Reported: exit code, wall time, the median step time and tokens/s after the first two
   steps (compilation), the largest memory metric, the console's first and last lines.
3. ``kill_resume``: the same command again, SIGKILLed (the whole process group) once its
   checkpoint at S/2 is intact and a step after it is in the ledger, then ``python train.py
   [--nproc G] --resume RUN_ID``; its ledger must equal the reference's byte for byte. With
   ``--concurrent`` the killed run starts beside the reference (both on the same GPUs), which halves
   the wall time of a slow recipe; the reference's step times are then those of a shared card.
4. ``export``: ``python -m training export --run RUN_ID --to DIR`` (LoRA/QLoRA: ``--merge``) of the
   reference run, then in a fresh process ``transformers`` loads it
   (``AutoModelForCausalLM``; the reward model: ``AutoModelForSequenceClassification``) with its
   tokenizer, renders a question with the chat template and checks the output is finite; a causal
   LM also greedily generates 8 tokens, and its logits are compared with Lockstep's own model of
   the run's last checkpoint (largest absolute difference, fp32).

Writes ``--out``/recipes.json (after each part of each recipe: a cut-short call keeps what finished) and one log
per recipe, ``--out``/RECIPE.log, with every command and its output; runs, weights and exports go
under ``--work`` (large, kept out of ``--out``). Exit 1 if any check failed.

Needs no network: the data is the embedded tasks (datasets/tasks, ``python -m data prepare``) and
the tokenizer datasets/tokenizers/qwen (``python -m data prepare --tokenizer qwen``); both are
git-ignored, so copy them to a machine that has a checkout without them. The commands run in
``--workdir`` (default: the repository root), where the configs' ``datasets/tasks/...`` paths
resolve; ``--tokenizer`` is the tokenizer the checkpoints get (default: the workdir's
datasets/tokenizers/qwen). Packages: torch, pyyaml,
numpy, psutil, pyarrow, zstandard (train.py refuses to start without it), safetensors, tokenizers,
jinja2 (chat templates), transformers; torchao for the QLoRA recipe (NF4).

``--tiny`` writes the 2-layer checkpoints of the same families (scripts/random_checkpoint.py
--tiny) and runs each recipe on CPU, shrunk (``SMOKE``): what tests/benchmarks/test_recipes_bench.py
runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


@dataclass(frozen=True)
class Recipe:
    arch: str
    """scripts/random_checkpoint.py --arch of its model."""
    export: tuple[str, ...] = ()
    """What `python -m training export` adds for it."""
    classifier: bool = False
    """Its export is a sequence classifier (a reward model)."""
    smoke: tuple[str, ...] = ()
    """What --tiny adds for it beyond SMOKE."""


RECIPES = {
    "qwen3-0.6b-sft": Recipe("qwen3-0.6b"),
    "qwen2.5-0.5b-lora-sft": Recipe("qwen2.5-0.5b", export=("--merge",)),
    "qwen3-1.7b-qlora-sft": Recipe("qwen3-1.7b", export=("--merge",)),
    "qwen3-0.6b-dpo": Recipe("qwen3-0.6b"),
    "qwen3-0.6b-grpo": Recipe("qwen3-0.6b", smoke=("objective.grpo.group_size=2", "objective.grpo.max_new_tokens=4")),
    "qwen3-0.6b-rm": Recipe("qwen3-0.6b", classifier=True),
    "qwen3-0.6b-ppo": Recipe("qwen3-0.6b", smoke=("objective.ppo.group_size=2", "objective.ppo.max_new_tokens=4")),
}

# Every run of the proof: no evaluation (its time is not the step's), no TensorBoard files.
COMMON = ("train.eval_interval=0", "metrics.tensorboard=false")

# --tiny: one CPU process, fp32, no compile, 4 rows of 64 tokens a step in 2 micro-batches.
SMOKE = ("parallel.device=cpu", "parallel.precision=fp32", "parallel.compile=false", "data.seq_len=64",
         "data.num_streams=2", "data.workers=0", "train.global_batch_size=4", "train.micro_batch_size=2",
         "train.warmup_steps=1", "checkpoint.async_save=false")

QUESTION = [{"role": "user", "content": "What is 6 * 5?"}]
NEEDED = ("datasets/tasks/sft/train", "datasets/tasks/pref/train", "datasets/tasks/rl/train")


class Log:
    """One recipe's log file: each command, then its output."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    def command(self, cmd: list[str]) -> None:
        with self.path.open("a") as f:
            f.write(f"\n$ {shlex.join(cmd)}\n")

    def note(self, text: str) -> None:
        with self.path.open("a") as f:
            f.write(f"# {text}\n")


def start(cmd: list[str], log: Log, cwd: Path) -> subprocess.Popen:
    """``cmd`` in ``cwd`` (--workdir: the configs' relative data paths resolve there), in a session
    of its own, its output appended to ``log``."""
    log.command(cmd)
    handle = log.path.open("a")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the command's whole process group (train.py and the ranks it launched) and wait."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def finish(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        return -9


def run(cmd: list[str], log: Log, args: argparse.Namespace) -> tuple[int, float]:
    began = time.monotonic()
    code = finish(start(cmd, log, args.workdir), args.timeout)
    return code, round(time.monotonic() - began, 1)


def train_command(gpus: int, args: list[str]) -> list[str]:
    return [PYTHON, str(ROOT / "train.py"), *(["--nproc", str(gpus)] if gpus > 1 else []), *args]


def run_dir(runs: Path, name: str) -> Path | None:
    found = sorted(runs.glob(f"{name}-*/ledger.jsonl"))
    return found[-1].parent if found else None


def ledger_lines(directory: Path) -> list[str]:
    path = directory / "ledger.jsonl"
    return path.read_text().splitlines() if path.is_file() else []


def checkpoint(recipe: Recipe, args: argparse.Namespace, log: Log) -> tuple[Path, dict]:
    """The recipe's random-init directory, written once per architecture."""
    out = args.work / "weights" / (recipe.arch + ("-tiny" if args.tiny else ""))
    cmd = [PYTHON, str(ROOT / "scripts" / "random_checkpoint.py"), "--arch", recipe.arch, "--out", str(out),
           "--seed", "0", "--tokenizer", str(args.tokenizer), *(["--tiny", "--dtype", "fp32"] if args.tiny else [])]
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        log.note(f"{out} exists (written earlier by: {shlex.join(cmd)})")
        return out, {"ok": True, "dir": str(out), "command": shlex.join(cmd), "reused": True}
    code, wall = run(cmd, log, args)
    return out, {"ok": code == 0, "dir": str(out), "command": shlex.join(cmd), "exit": code, "wall_s": wall}


def step_stats(directory: Path) -> dict:
    """Median step time and tokens/s after the first two steps, and the largest memory metrics."""
    path = directory / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    later = [m for m in lines if m.get("step", 0) > 2] or lines
    times = [m["metrics"]["step_time"]["mean"] for m in later if "step_time" in m.get("metrics", {})]
    tokens = {json.loads(line)["step"]: json.loads(line).get("tokens") for line in ledger_lines(directory)}
    rates = [tokens[m["step"]] / m["metrics"]["step_time"]["mean"] for m in later
             if tokens.get(m["step"]) and "step_time" in m.get("metrics", {})]
    memory: dict[str, float] = {}
    for m in lines:
        for key, value in m.get("metrics", {}).items():
            if key.startswith("mem/"):
                memory[key] = round(max(memory.get(key, 0.0), value["max"]), 2)
    return {"step_time_s": round(statistics.median(times), 3) if times else None,
            "tokens_per_s": round(statistics.median(rates)) if rates else None, "memory": memory}


def console(log_text: str, command_line: str) -> dict:
    """The console lines of one command in the log: its first 12 and last 4."""
    section = log_text.split(f"$ {command_line}\n", 1)[-1].split("\n$ ", 1)[0]
    lines = [line for line in section.splitlines() if line.strip()]
    return {"head": lines[:12], "tail": lines[-4:]}


def reference_run(name: str, train_args: list[str], args: argparse.Namespace, log: Log,
                  proc: subprocess.Popen | None = None, began: float | None = None) -> tuple[Path | None, dict]:
    """The reference run, S steps; ``proc``: it was started already (--concurrent) at ``began``."""
    cmd = train_command(args.gpus, [*train_args, f"run.name={name}-ref"])
    if proc is None:
        code, wall = run(cmd, log, args)
    else:
        code = finish(proc, max(1.0, args.timeout - (time.monotonic() - began)))
        wall = round(time.monotonic() - began, 1)
    directory = run_dir(args.work / "runs", f"{name}-ref")
    out: dict[str, Any] = {"ok": code == 0 and directory is not None and len(ledger_lines(directory)) == args.steps,
                           "command": shlex.join(cmd), "exit": code, "wall_s": wall,
                           "run_id": directory.name if directory else None, "concurrent": proc is not None}
    if directory is not None:
        out.update(step_stats(directory))
        out["console"] = console(log.path.read_text(errors="replace"), shlex.join(cmd))
    return directory, out


def kill_resume(name: str, train_args: list[str], args: argparse.Namespace, log: Log) -> tuple[Path | None, dict]:
    """The run again, SIGKILLed after its checkpoint at S/2 and a step beyond it, then resumed."""
    interval = max(1, args.steps // 2)
    runs = args.work / "runs"
    cmd = train_command(args.gpus, [*train_args, f"run.name={name}-kill"])
    proc = start(cmd, log, args.workdir)
    deadline = time.monotonic() + args.timeout
    directory = None
    while time.monotonic() < deadline and proc.poll() is None:
        directory = run_dir(runs, f"{name}-kill")
        if directory is not None and len(ledger_lines(directory)) > interval \
                and (directory / "checkpoints" / "LATEST").is_file():
            break
        time.sleep(0.05)
    if directory is None or proc.poll() is not None:
        finish(proc, 1)
        return None, {"ok": False, "command": shlex.join(cmd), "error": "the run ended (or never started) before the kill"}
    kill(proc)
    at_kill = len(ledger_lines(directory))
    latest = (directory / "checkpoints" / "LATEST").read_text().strip()
    log.note(f"SIGKILL after {at_kill} ledger lines, checkpoints/LATEST = {latest}")
    resume = train_command(args.gpus, ["--resume", directory.name, f"run.root={runs}"])
    code, wall = run(resume, log, args)
    return directory, {"ok": code == 0, "command": shlex.join(cmd), "resume_command": shlex.join(resume),
                       "killed_after_lines": at_kill, "latest_at_kill": latest, "resume_exit": code,
                       "resume_wall_s": wall, "run_id": directory.name}


def same_ledger(ref_dir: Path, directory: Path, result: dict) -> dict:
    """``result`` (kill_resume's) with the comparison of the two runs' ledgers, byte for byte."""
    ref, got = ledger_lines(ref_dir), ledger_lines(directory)
    first = next((i + 1 for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
    if first is None and len(ref) != len(got):
        first = min(len(ref), len(got)) + 1
    return {**result, "ok": result["ok"] and ref == got, "ledger_identical": ref == got, "first_differing_line": first}


def export(name: str, recipe: Recipe, ref_dir: Path, args: argparse.Namespace, log: Log) -> dict:
    target = args.work / "exports" / name
    cmd = [PYTHON, "-m", "training", "export", "--run", ref_dir.name, "--root", str(args.work / "runs"),
           "--to", str(target), "--overwrite", *recipe.export]
    code, wall = run(cmd, log, args)
    out: dict[str, Any] = {"ok": False, "command": shlex.join(cmd), "exit": code, "wall_s": wall, "dir": str(target)}
    if code != 0:
        return out
    check = [PYTHON, str(Path(__file__).resolve()), "--check-export", str(target), "--run-dir", str(ref_dir),
             *(["--classifier"] if recipe.classifier else []), *(["--tiny"] if args.tiny else [])]
    code, wall = run(check, log, args)
    found = [line for line in log.path.read_text(errors="replace").splitlines() if line.startswith("transformers: ")]
    out.update(ok=code == 0, check_command=shlex.join(check), check_exit=code,
               transformers=json.loads(found[-1].split(": ", 1)[1]) if code == 0 and found else None)
    return out


def check_export(directory: Path, run: Path, *, classifier: bool, cpu: bool) -> int:
    """transformers loads ``directory`` and its tokenizer, and what it computes is finite; a causal
    LM's logits are compared with Lockstep's model of ``run``'s last checkpoint (fp32)."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    device = "cuda" if torch.cuda.is_available() and not cpu else "cpu"
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=not classifier)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], device=device)
    auto = transformers.AutoModelForSequenceClassification if classifier else transformers.AutoModelForCausalLM
    theirs = auto.from_pretrained(directory, dtype=torch.float32).to(device).eval()
    result: dict[str, Any] = {"class": type(theirs).__name__, "device": device, "tokens": ids.shape[1]}
    with torch.no_grad():
        output = theirs(ids).logits.float()
        result.update(finite=bool(torch.isfinite(output).all()), shape=list(output.shape))
        if classifier:
            result["score"] = output.flatten().tolist()
        else:
            generated = theirs.generate(ids, max_new_tokens=8, do_sample=False)
            result["generated_tokens"] = generated.shape[1] - ids.shape[1]
            result["max_abs_logit_diff"] = ours_against(output, ids, run)
    print("transformers: " + json.dumps(result), flush=True)
    return 0 if result["finite"] else 1


def ours_against(theirs, ids, run: Path) -> float:
    """The largest absolute difference of Lockstep's logits (the run's last checkpoint, fp32) from ``theirs``."""
    import torch

    from core import config as config_lib
    from core.layout import RunPaths
    from models import ModelInputs, model_forward
    from training.checkpoint.load import checkpoint_dir, load_checkpoint_model

    paths = RunPaths(run)
    ours = load_checkpoint_model(config_lib.load(paths.config), checkpoint_dir(paths, None)).to(ids.device).eval()
    with torch.no_grad():
        logits = model_forward(ours, ModelInputs(ids)).logits
        return float((logits.float() - theirs).abs().max())


def environment() -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"commit": commit or None, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def prove(name: str, args: argparse.Namespace, result: dict, save) -> None:
    """Fills ``result`` part by part, calling ``save`` after each (a call cut short keeps what finished)."""
    recipe = RECIPES[name]
    log = Log(args.out / f"{name}.log")
    weights, result["checkpoint"] = checkpoint(recipe, args, log)
    written = result["checkpoint"]
    save()
    if not written["ok"]:
        return
    train_args = ["--config", str(ROOT / "configs" / f"{name}.yaml"), f"model.init_from={weights}",
                  f"run.root={args.work / 'runs'}", f"train.max_steps={args.steps}",
                  f"checkpoint.interval={max(1, args.steps // 2)}", *COMMON,
                  *((*SMOKE, *recipe.smoke) if args.tiny else ()), *args.set]
    if args.concurrent:
        began = time.monotonic()
        proc = start(train_command(args.gpus, [*train_args, f"run.name={name}-ref"]), log, args.workdir)
        killed_dir, killed = kill_resume(name, train_args, args, log)
        ref_dir, result["reference"] = reference_run(name, train_args, args, log, proc, began)
    else:
        ref_dir, result["reference"] = reference_run(name, train_args, args, log)
        save()
        if ref_dir is None or not result["reference"]["ok"]:
            return
        killed_dir, killed = kill_resume(name, train_args, args, log)
    finished = ref_dir is not None and result["reference"]["ok"] and killed_dir is not None
    result["kill_resume"] = same_ledger(ref_dir, killed_dir, killed) if finished else {
        **killed, "ok": False, "error": killed.get("error", "the reference run failed: no ledger to compare with")}
    save()
    if ref_dir is None or not result["reference"]["ok"]:
        return
    result["export"] = export(name, recipe, ref_dir, args, log)
    save()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="where recipes.json and the logs go")
    p.add_argument("--work", type=Path, default=Path("/tmp/lockstep-recipes"),
                   help="where the weights, runs and exports go")
    p.add_argument("--steps", type=int, default=20, help="steps of each run (the kill lands after steps/2)")
    p.add_argument("--recipes", default="all", help=f"comma-separated, of: {', '.join(RECIPES)}")
    p.add_argument("--gpus", type=int, default=1, help="ranks of each run (python train.py --nproc G)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (e.g. parallel.compile=false)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds each command may take")
    p.add_argument("--concurrent", action="store_true",
                   help="start the kill run beside the reference (one card, two runs: half the wall time; "
                        "the step times are the shared card's)")
    p.add_argument("--tiny", action="store_true", help="2-layer checkpoints, CPU, shrunk runs (SMOKE): a smoke")
    p.add_argument("--workdir", type=Path, default=ROOT, help="where the commands run (datasets/tasks/ there)")
    p.add_argument("--tokenizer", type=Path, help="the checkpoints' tokenizer (default: WORKDIR/datasets/tokenizers/qwen)")
    p.add_argument("--check-export", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--classifier", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.check_export is not None:
        return check_export(args.check_export, args.run_dir, classifier=args.classifier, cpu=args.tiny)
    if args.out is None:
        p.error("--out is required")
    names = list(RECIPES) if args.recipes == "all" else args.recipes.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        p.error(f"unknown recipe(s) {', '.join(unknown)}; known: {', '.join(RECIPES)}")
    if args.steps < 2:
        p.error("--steps must be at least 2 (the kill lands after steps/2)")
    args.workdir = args.workdir.resolve()
    args.tokenizer = (args.tokenizer or args.workdir / "datasets" / "tokenizers" / "qwen").resolve()
    missing = [str(args.workdir / path) for path in NEEDED if not (args.workdir / path).exists()]
    missing += [] if (args.tokenizer / "tokenizer.json").is_file() else [str(args.tokenizer / "tokenizer.json")]
    if missing:
        p.error(f"missing {', '.join(missing)}: run `python -m data prepare` and `python -m data prepare "
                "--tokenizer qwen`, or copy datasets/tasks and datasets/tokenizers/qwen from a checkout that has them")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = args.work.resolve()
    report: dict[str, Any] = {"environment": environment(), "steps": args.steps, "gpus": args.gpus,
                              "tiny": args.tiny, "concurrent": args.concurrent, "set": args.set, "recipes": {}}

    def save() -> None:
        (args.out / "recipes.json").write_text(json.dumps(report, indent=1) + "\n")

    for name in names:
        prove(name, args, report["recipes"].setdefault(name, {}), save)
    failed = [n for n, r in report["recipes"].items() if not all(part.get("ok") for part in r.values())
              or set(r) != {"checkpoint", "reference", "kill_resume", "export"}]
    for name, r in report["recipes"].items():
        ref = r.get("reference", {})
        print(f"{name}: {'ok' if name not in failed else 'FAILED'} | {ref.get('step_time_s')} s/step "
              f"{ref.get('tokens_per_s')} tok/s | ledger after kill+resume identical: "
              f"{r.get('kill_resume', {}).get('ledger_identical')} | transformers: "
              f"{(r.get('export') or {}).get('transformers')}")
    print(f"wrote {args.out / 'recipes.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
