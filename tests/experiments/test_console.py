"""experiments/console.py and the console sink: a method's units and fields, progress counts."""

from __future__ import annotations

import dataclasses

import torch

from core.config import Config, MetricsConfig
from core.distributed_context import DistributedContext
from experiments.console import HEARTBEAT_S, ConsoleField, ConsoleLine, Heartbeat, Progress, eval_line
from experiments.schema import MetricRecord, MetricStats
from experiments.sinks import format_progress
from experiments.tracking import MetricsTracker
from training.objectives import objective_class
from training.objectives.grpo import GRPOObjective

PAIRS = ConsoleLine(unit="pair", fields=(ConsoleField("accuracy", "objective/accuracies"),
                                         ConsoleField("logp chosen", "objective/policy_chosen_logps", ".2f"),
                                         ConsoleField("absent", "objective/not_logged")))


def _record(**means: float) -> MetricRecord:
    stats = {name: MetricStats(mean=v, min=v, max=v, sum=v) for name, v in means.items()}
    return MetricRecord(step=3, time=0.0, world_size=1, interval_steps=1, metrics=stats, tokens_per_s=500.0)


def test_the_step_line_shows_the_unit_and_the_declared_fields_in_order():
    record = _record(**{"loss": 0.69312, "lr": 1e-3, "objective/accuracies": 0.625,
                        "objective/policy_chosen_logps": -72.184})
    line = format_progress(record, 10, PAIRS)
    assert line == ("step 3/10 | loss 0.6931 per pair | accuracy 0.6250 | logp chosen -72.18 | lr 1.00e-03 "
                    "| 500 tok/s")


def test_a_line_without_a_loss_label_hides_the_loss_and_without_a_line_the_old_format_stays():
    record = _record(loss=-0.209, **{"reward_mean": 0.209})
    hidden = ConsoleLine(unit="prompt", loss=None, fields=(ConsoleField("reward", "reward_mean"),))
    assert format_progress(record, 10, hidden) == "step 3/10 | reward 0.2090 | 500 tok/s"
    assert format_progress(record, 10) == "step 3/10 | loss -0.2090 | 500 tok/s"


def test_a_mixture_of_experts_shows_its_balance_over_every_layer_after_its_aux_loss():
    record = _record(**{"loss": 2.5, "model/aux/load_balance": 1.0123, "model/layer1_load_min": 0.62,
                        "model/layer1_load_max": 1.2, "model/layer3_load_min": 0.7, "model/layer3_load_max": 1.414,
                        "model/layer1_bias_min": -0.0012, "model/layer1_bias_max": 0.0005,
                        "model/layer3_bias_min": -0.0003, "model/layer3_bias_max": 0.0034})
    assert format_progress(record, 10) == ("step 3/10 | loss 2.5000 | aux load_balance 1.0123 | load 0.62-1.41 "
                                           "| bias -1.2e-03..3.4e-03 | 500 tok/s")
    without_bias = _record(**{"model/layer1_load_min": 0.9, "model/layer1_load_max": 1.1})
    assert format_progress(without_bias, 10) == "step 3/10 | load 0.90-1.10 | 500 tok/s"


def test_the_eval_line_counts_its_units():
    values = {"loss": 0.5, "objective/accuracies": 0.75}
    assert eval_line(8, 64, values, PAIRS) == "eval step 8 over 64 pairs: loss 0.5000 | accuracy 0.7500"
    assert eval_line(8, 1, values, PAIRS).startswith("eval step 8 over 1 pair: ")
    assert eval_line(8, 0, {"loss": float("nan"), "objective/accuracies": 0.5}, PAIRS) == "eval step 8: accuracy 0.5000"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_progress_prints_counts_at_most_every_interval():
    clock, printed = _Clock(), []
    with Progress("eval step 40", 6, unit="batches", print_fn=printed.append, tty=False, interval_s=5.0,
                  clock=clock) as progress:
        for seconds in (2.0, 4.0, 1.0, 6.0, 1.0, 9.0):  # the time each batch takes
            clock.now += seconds
            progress.advance()
    # done at 2, 6, 7, 13, 14, 23 s: a line at 6 s and 13 s (5 s apart or more); the last batch
    # ends the phase, whose own line (the eval line) follows
    assert printed == ["eval step 40: 2/6 batches, 6.0 s", "eval step 40: 4/6 batches, 13.0 s"]


def test_progress_on_another_rank_or_a_terminal_prints_no_plain_lines(capsys):
    printed = []
    with Progress("eval", 3, unit="batches", enabled=False, print_fn=printed.append, tty=False,
                  interval_s=0.0) as progress:
        for _ in range(3):
            progress.advance()
    with Progress("eval", 3, unit="batches", print_fn=printed.append, tty=True, interval_s=0.0) as progress:
        assert progress._bar is not None  # a rich progress bar, transient
        for _ in range(3):
            progress.advance()
    assert printed == []


def test_progress_can_count_more_items_than_it_started_with():
    clock, printed = _Clock(), []
    with Progress("step 3 rollouts", 4, unit="samples", print_fn=printed.append, tty=False, interval_s=0.0,
                  clock=clock) as progress:
        progress.advance(4)  # the first round: all done, no line (the phase's own lines follow)
        progress.extend(2)  # a re-sampling round
        clock.now += 1.0
        progress.advance(1)
        progress.advance(1)
    assert printed == ["step 3 rollouts: 5/6 samples, 1.0 s"]


def test_the_heartbeat_writes_a_line_after_30_quiet_seconds_naming_the_step_and_its_phase():
    clock, printed = _Clock(), []
    heartbeat = Heartbeat(200, print_fn=printed.append, clock=clock)
    assert HEARTBEAT_S == 30.0 and heartbeat.interval_s == HEARTBEAT_S
    clock.now += 29.0
    assert heartbeat.tick() is None  # quiet for less than the interval
    heartbeat.at(37, "running (prepare)")
    clock.now += 12.0  # 41 s since the last line, 12 s into step 37
    assert heartbeat.tick() == "step 37/200 running (prepare): 12 s into the step, 41 s since the last line"
    clock.now += 20.0
    assert heartbeat.tick() is None  # its own line counts: the next one is due 30 s after it
    heartbeat.at(37, "running (update)")  # the same step: its start stays
    clock.now += 10.0
    assert heartbeat.tick() == "step 37/200 running (update): 42 s into the step, 30 s since the last line"
    clock.now += 25.0
    heartbeat.touch()  # a step line
    clock.now += 29.0
    assert heartbeat.tick() is None
    heartbeat.at(38)
    clock.now += 1.0
    assert heartbeat.tick() == "step 38/200 running: 1 s into the step, 30 s since the last line"
    assert len(printed) == 3


def test_the_heartbeat_before_the_first_step_and_on_another_rank():
    clock, printed = _Clock(), []
    first, other = (Heartbeat(10, enabled=enabled, print_fn=printed.append, clock=clock) for enabled in (True, False))
    clock.now += 31.0  # restoring a checkpoint, compiling
    assert first.tick() == "starting: 31 s since the last line"
    assert other.tick() is None
    assert printed == ["starting: 31 s since the last line"]


def test_the_heartbeat_thread_hears_the_loggers_lines_and_stops():
    import logging
    import time as real_time

    clock, printed, logger = _Clock(), [], logging.getLogger("lockstep.test_heartbeat")
    logger.setLevel(logging.INFO)
    heartbeat = Heartbeat(5, print_fn=printed.append, clock=clock)
    heartbeat.start(period_s=0.01, listen=logger)
    try:
        clock.now += 29.0
        logger.info("an eval line")  # heard: the quiet starts again
        clock.now += 2.0
        logging.getLogger("lockstep.test_heartbeat.events").info("event x")  # events reach no console: not heard
        clock.now += 29.0
        deadline = real_time.monotonic() + 10.0
        while not printed and real_time.monotonic() < deadline:
            real_time.sleep(0.01)
        assert printed == ["starting: 31 s since the last line"]
    finally:
        heartbeat.stop()
    assert not logger.handlers and heartbeat._thread is None


def test_grpo_declares_its_fields_from_its_settings():
    g = Config().objective.grpo
    plain = GRPOObjective._console_lines(g)
    assert plain.step.unit == "completion" and plain.eval.unit == "prompt" and plain.eval.loss is None
    assert "kl" not in _labels(plain.step) and "pass@1" not in _labels(plain.eval)
    tuned = GRPOObjective._console_lines(dataclasses.replace(g, kl_coef=0.05, eval_samples=4, loss_norm="token"))
    assert tuned.step.unit == "token"
    assert _labels(tuned.step) == ["reward", "reward std", "kl", "clip", "len"]
    assert _labels(tuned.eval) == ["reward", "accuracy", "sampled reward", "pass@1"]


def test_agent_runs_show_tool_calls_and_malformed_calls_on_the_step_line():
    from training.objectives.ppo import PPOObjective
    from training.rollout.environment_settings import EnvironmentSettings

    tools = EnvironmentSettings(name="calculator")
    g, p = Config().objective.grpo, Config().objective.ppo
    for lines in (GRPOObjective._console_lines(dataclasses.replace(g, environment=tools)),
                  PPOObjective._console_lines(dataclasses.replace(p, environment=tools))):
        assert _labels(lines.step)[-2:] == ["tool calls", "malformed calls"]
        record = _record(loss=0.1, lr=1e-3, reward_mean=0.5, tool_calls=12.0, malformed_calls=1.0)
        assert " | tool calls 12.0 | malformed calls 1.0 | lr 1.00e-03 | " in format_progress(record, 10, lines.step)
    for lines in (GRPOObjective._console_lines(g), PPOObjective._console_lines(p)):  # no environment: no fields
        assert "tool calls" not in _labels(lines.step)


def test_dpo_counts_pairs_and_pretraining_tokens():
    dpo, causal_lm, sft = objective_class("dpo"), objective_class("causal_lm"), objective_class("sft")
    assert dpo.console.step.unit == dpo.console.eval.unit == "pair"
    assert causal_lm.console.eval.unit == "token" and not causal_lm.console.step.fields
    assert _labels(sft.console.step) == ["trained tokens"]


def _labels(line: ConsoleLine) -> list[str]:
    return [f.label for f in line.fields]


def test_the_tracker_prints_the_line_the_trainer_shows_it():
    printed = []
    tracker = MetricsTracker(MetricsConfig(log_interval=1), dist=DistributedContext(
        rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", timeout_s=10),
        run_dir=None, total_steps=2, flops_per_token=None, peak_flops=None, print_fn=printed.append)
    tracker.show(ConsoleLine(unit="completion", fields=(ConsoleField("reward", "reward_mean"),)))
    tracker.log(1, {"loss": 0.25, "reward_mean": 0.5, "lr": 1e-3})
    tracker.close()
    (line,) = printed
    assert line.startswith("step 1/2 | loss 0.2500 per completion | reward 0.5000 | lr 1.00e-03 | ETA ")
