"""experiments/plots.py and ``runs plot``: every numeric series, grouped, eval curves beside
training ones, one PNG per run and a comparison; the series drawn are read back from the JSON
that the command writes from the figure's axes."""

from __future__ import annotations

import json

from experiments.__main__ import main
from experiments.plots import group_of, panels, run_series, series_path


def _write_run(root, run_id, *, losses, rewards, eval_rewards):
    run = root / run_id
    run.mkdir(parents=True)
    (run / "meta.json").write_text("{}")
    with open(run / "ledger.jsonl", "w") as f:
        for step, (loss, reward) in enumerate(zip(losses, rewards), start=1):
            f.write(json.dumps({"step": step, "loss": loss, "lr": 0.01 * step, "reward_mean": reward,
                                "rollout_hash": "ab" * 32, "skipped": False,
                                "inner_losses": [loss, loss / 2]}) + "\n")
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1, len(losses) + 1):
            f.write(json.dumps({"schema_version": 1, "step": step, "time": 1.0, "world_size": 1, "interval_steps": 1,
                                "metrics": {"loss": {"mean": 99.0}, "objective/kl": {"mean": 0.1 * step},
                                            "mem/rss_gib": {"mean": 1.5}},
                                "slowest_rank": 0, "tokens_per_s": 1000.0 * step, "mfu": None}) + "\n")
    with open(run / "events.jsonl", "w") as f:
        for step, reward in eval_rewards:
            f.write(json.dumps({"event": "eval", "time": 1.0, "rank": 0, "step": step, "loss": -reward,
                                "tokens": 8, "unit": "prompt", "metrics": {"reward_mean": reward, "accuracy": 0.5}})
                    + "\n")
    return run


def test_every_numeric_series_of_ledger_metrics_and_evals(tmp_path):
    run = _write_run(tmp_path, "a-1", losses=[3.0, 2.0, 1.0], rewards=[0.1, 0.2, 0.3], eval_rewards=[(2, 0.25)])
    with open(run / "ledger.jsonl", "a") as f:  # resumed from step 2: step 3 again, the last record wins
        f.write(json.dumps({"step": 3, "loss": 1.5, "lr": 0.03, "reward_mean": 0.35}) + "\n")
    series = run_series(run)
    assert series["loss"] == [(1, 3.0), (2, 2.0), (3, 1.5)]  # the ledger's exact loss, not the metrics' mean
    assert series["inner_losses[1]"] == [(1, 1.5), (2, 1.0)]
    assert series["objective/kl"] == [(1, 0.1), (2, 0.2), (3, 0.30000000000000004)]
    assert series["tokens_per_s"] == [(1, 1000.0), (2, 2000.0), (3, 3000.0)]
    assert series["eval/loss"] == [(2, -0.25)] and series["eval/reward_mean"] == [(2, 0.25)]
    assert "rollout_hash" not in series and "skipped" not in series and "mfu" not in series


def test_groups_and_the_eval_curve_beside_its_training_curve(tmp_path):
    run = _write_run(tmp_path, "a-1", losses=[3.0, 2.0], rewards=[0.1, 0.2], eval_rewards=[(2, 0.25)])
    laid = {name: (group, lines) for group, name, lines in panels(run_series(run))}
    assert laid["reward_mean"] == ("rewards and accuracy", {"train": [(1, 0.1), (2, 0.2)], "eval": [(2, 0.25)]})
    assert laid["eval/accuracy"] == ("rewards and accuracy", {"eval": [(2, 0.5)]})  # no training twin
    assert laid["eval/loss"][0] == "loss" and "eval" not in laid["loss"][1]  # other units: its own panel
    assert [group_of(n) for n in ("objective/kl", "lr", "mem/rss_gib", "tokens_per_s", "objective/ce", "pairs")] == [
        "KL and clipping", "optimisation", "memory", "throughput and time", "loss", "counts"]


def test_runs_plot_draws_the_series_and_compares_runs(tmp_path, capsys):
    root = tmp_path / "runs"
    a = _write_run(root, "a-1", losses=[3.0, 2.0], rewards=[0.1, 0.2], eval_rewards=[(2, 0.25)])
    b = _write_run(root, "b-1", losses=[4.0, 1.0, 0.5], rewards=[0.0, 0.4, 0.6], eval_rewards=[(3, 0.5)])
    assert main(["runs", "plot", "a-1", "--root", str(root)]) == 0
    png = a / "artifacts" / "plots.png"
    assert capsys.readouterr().out.split() == [str(png)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = {p["series"]: p for p in json.loads(series_path(png).read_text())["panels"]}
    assert drawn["reward_mean"]["lines"] == {"train": [[1, 0.1], [2, 0.2]], "eval": [[2, 0.25]]}
    assert drawn["loss"]["group"] == "loss" and drawn["loss"]["lines"] == {"train": [[1, 3.0], [2, 2.0]]}

    assert main(["runs", "plot", "a-1", "b-1", "--root", str(root), "--out", str(tmp_path / "cmp.png")]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(png), str(b / "artifacts" / "plots.png"), str(tmp_path / "cmp.png")]
    compared = {p["series"]: p["lines"] for p in json.loads((tmp_path / "cmp.json").read_text())["panels"]}
    assert compared["loss"] == {"a-1": [[1, 3.0], [2, 2.0]], "b-1": [[1, 4.0], [2, 1.0], [3, 0.5]]}
    assert compared["eval/reward_mean"] == {"a-1": [[2, 0.25]], "b-1": [[3, 0.5]]}

    assert main(["runs", "plot", "a-1", "b-1", "--root", str(root)]) == 0  # default: a name from the run IDs
    default = capsys.readouterr().out.split()[-1]
    assert default.startswith(str(root / "compare-")) and default.endswith(".png")


def test_runs_plot_of_an_unknown_run_is_a_usage_error(tmp_path, capsys):
    _write_run(tmp_path, "a-1", losses=[1.0], rewards=[0.0], eval_rewards=[])
    assert main(["runs", "plot", "a-1", "nope", "--root", str(tmp_path)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err
