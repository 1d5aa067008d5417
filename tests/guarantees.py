"""The four guarantees every training method keeps, checked end to end on CPU ranks (gloo).

A ``Method`` is one row of the table in tests/methods.py: a config, its overrides, what the
run needs prepared (a base model, a teacher), and the few per-method parameters of the checks
below. tests/training/test_guarantees.py runs the four checks on every row:

1. ``sigkill_then_resume_is_identical``: the 2-rank job SIGKILLed at a random moment (mid-step,
   mid-rollout, mid-checkpoint; the pretraining rows several times), resumed by run ID each time, ends with the uninterrupted
   run's ledger, line for line and bit for bit (every field: loss, grad_norm, param_hash,
   rollout_hash, ...), and leaves no run-dir lock behind;
2. ``replay_verifies``: ``--replay`` of steps before and after a checkpoint matches the ledger,
   and its ``--dump`` holds the step's provenance, activations and (but under FSDP2)
   parameter gradients;
3. ``one_rank_resume_keeps_the_batches``: the 2-rank run's checkpoint resumed on 1 rank keeps
   the ledger up to the checkpoint, sees the same batches (and the fields ``one_rank_same``) and
   the same data position, with losses within fp32 noise of the other reduction order;
4. ``accumulation_changes_nothing``: ``micro_batch_size`` 1 against 4 on one rank (8 x 1 against
   2 x 4 for e2e.yaml's global batch of 8): the same data position, the same batches, the same
   loss within fp32 noise of the summation order (and the fields ``accumulation_close``).

The uninterrupted 2-rank run of a row is trained once per test session and process
(``References``, the ``reference_runs`` fixture of tests/conftest.py): the four checks and the
method's own e2e file read the same run. ``make test`` puts a row's checks and its method's
file on one pytest worker (tests/methods.py, ``worker_group``), so that run is trained once there too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import yaml

from tests import launch

CONFIGS = launch.ROOT / "tests" / "configs"


@dataclass(frozen=True)
class Kill:
    """How the kill/resume check interrupts the job.

    ``kills`` SIGKILLs of the whole job, each ``steps`` (a random count in the range) ledger lines
    after a (re)start, then up to ``delay_s`` later (tests/launch.py, ``kill_and_resume``). One
    kill gives a method's own state (a cache, a critic, a rollout) one interrupted resume; the
    pretraining rows kill a resumed job again (``kills`` 3 and 2): the resume path is one for
    every method, and each start of the job is a process launch, the suite's main cost.
    ``stall``: instead, one kill at a known point: step 5's data is stalled and the job killed
    there, after the step-4 line, with the step-4 checkpoint complete or torn
    (``stall_kill_and_resume``; the run needs 6 steps and a checkpoint at step 4)."""

    seed: int
    kills: int = 1
    steps: tuple[int, int] = (1, 3)
    delay_s: float = 0.2
    wait_s: float = 120
    finish_s: float = 300
    stall: bool = False


@dataclass(frozen=True)
class Method:
    """One row of the guarantee table: a training method as the e2e suite runs it.

    A run's arguments are ``--config tests/configs/<config> run.name=... train.max_steps=...``,
    then ``overrides``, then what ``prepare`` returned. A field left at its default is the
    common case; the notes say why a row differs."""

    name: str
    config: str
    steps: int = 8
    entry: str = launch.TRAIN
    """The script every run of the row starts (a path from the repository root): train.py, or
    a test's copy of it that registers a kind of its own first (tests/training/two_part_train.py)."""
    overrides: tuple[str, ...] = ()
    prepare: Callable[[Path], tuple[str, ...]] | None = None
    """Writes what the runs read into the working directory (a base model, a teacher run)
    and returns the overrides naming it; called once per session."""
    e2e_file: str | None = None
    """The method's own e2e file in tests/training/, which reads this row's runs."""
    timeout_s: float = 300
    kill: Kill = Kill(seed=7)
    kill_overrides: Callable[[Path], tuple[str, ...]] | None = None
    """Overrides for the killed run only, from the working directory (DPO: a cache of its own)."""
    needs: tuple[str, ...] = ()
    """Optional packages the method runs on (QLoRA: torchao); without one its checks are skipped."""
    replay_steps: tuple[int, ...] = (3, 6)
    one_rank_step: int = 4
    one_rank_overrides: tuple[str, ...] = ()
    """Resumable keys the 1-rank resume sets (a row at ``parallel.ep=2``: ``parallel.ep=1``)."""
    one_rank_same: tuple[str, ...] = ("batch_hash",)
    """Ledger fields the 1-rank resume keeps at every step (``data_state_hash`` always)."""
    one_rank_close: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Ledger fields besides the loss that the 1-rank resume keeps within ``(rel, abs)``."""
    samples_from_weights: bool = False
    """The batches hold what the trained weights produced (GRPO: rollouts, old log-probs). Two
    runs that round an update differently (1 against 2 ranks, other micro-batch sizes) then
    share the batch only at the first step after their common start: later steps are compared
    by the prompts they consume (``data_state_hash``) only."""
    one_rank_loss_rel: float = 1e-4
    """How close the 1-rank resume's losses stay: fp32 noise of the other reduction order,
    unless the row's notes (tests/methods.py) say why its method rounds otherwise."""
    accumulation_steps: int = 2
    accumulation_loss_rel: float = 1e-5
    """How close the two micro-batch sizes' losses stay: fp32 noise of the summation order,
    unless the row's notes say otherwise."""
    accumulation_overrides: tuple[str, ...] = ()
    accumulation_close: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Ledger fields besides the loss compared within ``(rel, abs)`` across micro-batch sizes."""

    @property
    def config_path(self) -> Path:
        return CONFIGS / self.config


class References:
    """Per-session cache of what the rows need: ``prepare``'s overrides and the uninterrupted
    2-rank run. A failed run fails every test that asks for it, without training it again."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._inputs: dict[str, tuple[str, ...]] = {}
        self._runs: dict[str, launch.Result] = {}

    def inputs(self, method: Method) -> tuple[str, ...]:
        for module in method.needs:
            pytest.importorskip(module)
        if method.name not in self._inputs:
            self._inputs[method.name] = method.prepare(self.workdir) if method.prepare else ()
        return self._inputs[method.name]

    def prepared(self, method: Method, key: str) -> str:
        """The value ``prepare`` gave the config key ``key`` (e.g. the base model's directory)."""
        values = [o.split("=", 1)[1] for o in self.inputs(method) if o.split("=", 1)[0] == key]
        assert len(values) == 1, f"the {method.name} row prepares no single {key}: {self.inputs(method)}"
        return values[0]

    def args(self, method: Method, *, name: str, max_steps: int | None = None, overrides=()) -> list[str]:
        steps = method.steps if max_steps is None else max_steps
        return ["--config", str(method.config_path), f"run.name={name}", f"train.max_steps={steps}",
                *method.overrides, *self.inputs(method), *overrides]

    def result(self, method: Method) -> launch.Result:
        """The row's uninterrupted 2-rank run (run.name ``ref-<row>``), trained on first use."""
        if method.name not in self._runs:
            self._runs[method.name] = launch.train(self.workdir, self.args(method, name=f"ref-{method.name}"),
                                                   nproc=2, timeout=method.timeout_s, entry=method.entry)
        result = self._runs[method.name]
        assert result.returncode == 0, f"the {method.name} reference run failed:\n{result.stderr}"
        return result

    def run(self, method: Method) -> Path:
        """The run dir of ``result(method)``, holding a ledger line for each of the row's steps."""
        found = run_dir(self.workdir, self.result(method))
        assert [r["step"] for r in launch.ledger(found)] == list(range(1, method.steps + 1))
        return found


def run_dir(workdir: Path, result: launch.Result) -> Path:
    return result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


def strategy(run: Path) -> str:
    """The run's ``parallel.strategy``, from the config it recorded."""
    return yaml.safe_load((run / "config.yaml").read_text())["parallel"]["strategy"]


def sigkill_then_resume_is_identical(refs: References, method: Method) -> None:
    reference = refs.run(method)
    name = f"killed-{method.name}"
    extra = method.kill_overrides(refs.workdir) if method.kill_overrides else ()
    args = refs.args(method, name=name, overrides=extra)
    kill = method.kill
    if kill.stall:
        killed = launch.stall_kill_and_resume(refs.workdir, args, name=name, entry=method.entry)
    else:
        killed = launch.kill_and_resume(refs.workdir, args, name=name, seed=kill.seed, kills=kill.kills,
                                        steps=kill.steps, delay_s=kill.delay_s, wait_s=kill.wait_s,
                                        finish_s=kill.finish_s, entry=method.entry, last_step=method.steps)
    got, want = launch.ledger(killed), launch.ledger(reference)
    assert got == want, ledger_difference(got, want, killed)
    assert not (killed / ".lock").exists()


def ledger_difference(got: list[dict], want: list[dict], run: Path) -> str:
    """What a killed-and-resumed ledger does differently from the uninterrupted one, for the failure's
    message (the run dirs do not outlive a passing session): the line counts, the first step that
    differs with each differing field's two values, and the killed run's lifecycle events."""
    lines = [f"{len(got)} lines resumed, {len(want)} uninterrupted"]
    for mine, theirs in zip(got, want):
        if mine != theirs:
            keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            lines.append(f"step {theirs.get('step')}: " + "; ".join(
                f"{k} resumed {mine.get(k)!r} uninterrupted {theirs.get(k)!r}" for k in keys))
            break
    lines += [json.dumps({k: v for k, v in e.items() if k in ("event", "step", "path", "reason", "rank", "exit_code")})
              for e in launch.events(run) if e.get("event") not in ("step", "eval")]
    return "\n".join(lines)


def replay_verifies(refs: References, method: Method, dumps: Path) -> None:
    reference = refs.run(method)
    for step in method.replay_steps:
        dump = dumps / f"step{step}"
        result = launch.train(refs.workdir, ["--replay", reference.name, "--step", str(step), "--dump", str(dump)],
                              nproc=2, timeout=method.timeout_s, entry=method.entry)
        assert result.returncode == 0, result.stderr
        assert "match" in result.stdout, result.stdout
        summary = json.loads((dump / "rank0_step.json").read_text())
        assert summary["provenance"] and summary["activations"], step
        assert summary["param_grads"], step  # under FSDP2 too: read from .grad before the optimizer steps
        assert (dump / "rank1_batch.pt").exists()


def one_rank_resume_keeps_the_batches(refs: References, method: Method) -> None:
    reference, cut = refs.run(method), method.one_rank_step
    copy = launch.cut_back_copy(reference, cut, "-one-rank")
    resumed = launch.train(refs.workdir, ["--resume", copy.name, *method.one_rank_overrides], nproc=1,
                           timeout=method.timeout_s, entry=method.entry)
    assert resumed.returncode == 0, resumed.stderr
    ref, got = launch.ledger(reference), launch.ledger(copy)
    assert [r["step"] for r in got] == list(range(1, method.steps + 1))
    assert got[:cut] == ref[:cut]
    assert [r["data_state_hash"] for r in got] == [r["data_state_hash"] for r in ref]
    end = cut + 1 if method.samples_from_weights else method.steps
    for key in method.one_rank_same:
        assert [r[key] for r in got[cut:end]] == [r[key] for r in ref[cut:end]], key
    for a, b in zip(ref[cut:end], got[cut:end]):
        assert b["loss"] == pytest.approx(a["loss"], rel=method.one_rank_loss_rel, abs=1e-5), a["step"]
        for key, (rel, abs_) in method.one_rank_close.items():
            assert b[key] == pytest.approx(a[key], rel=rel, abs=abs_), (key, a["step"])


def accumulation_changes_nothing(refs: References, method: Method) -> None:
    # The two runs share one import of train.py's modules (launch.train_in_turn).
    results = launch.train_in_turn(refs.workdir, [refs.args(
        method, name=f"acc{micro}-{method.name}", max_steps=method.accumulation_steps,
        overrides=[f"train.micro_batch_size={micro}", *method.accumulation_overrides]) for micro in (1, 4)],
        timeout=method.timeout_s, entry=method.entry)
    ledgers = []
    for result in results:
        assert result.returncode == 0, result.stderr
        ledgers.append(launch.ledger(run_dir(refs.workdir, result)))
    by_one, by_four = ledgers
    assert len(by_one) == len(by_four) == method.accumulation_steps
    assert [r["data_state_hash"] for r in by_one] == [r["data_state_hash"] for r in by_four]
    end = 1 if method.samples_from_weights else method.accumulation_steps
    by_one, by_four = by_one[:end], by_four[:end]
    assert [r["batch_hash"] for r in by_one] == [r["batch_hash"] for r in by_four]
    for x, y in zip(by_one, by_four):
        # abs: a loss near zero (GRPO's first update, whose advantages sum to zero) is all noise
        assert x["loss"] == pytest.approx(y["loss"], rel=method.accumulation_loss_rel, abs=1e-6), x["step"]
        for key, (rel, abs_) in method.accumulation_close.items():
            assert x[key] == pytest.approx(y[key], rel=rel, abs=abs_), (key, x["step"])
