"""experiments/plots.py and ``runs plot``: every numeric series, grouped, eval curves beside
training ones, one PNG per run and a comparison; the series drawn are read back from the JSON
that the command writes from the figure's axes."""

from __future__ import annotations

import json

from experiments.__main__ import main
from experiments.plots import group_of, panels, plot_comparison, run_series, series_path


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

    # Without --out the comparison is named from the run IDs (whatever is drawn: one series here).
    assert main(["runs", "plot", "a-1", "b-1", "--root", str(root), "--series", "loss"]) == 0
    default = capsys.readouterr().out.split()[-1]
    assert default.startswith(str(root / "compare-")) and default.endswith(".png")


def test_runs_plot_of_an_unknown_run_is_a_usage_error(tmp_path, capsys):
    _write_run(tmp_path, "a-1", losses=[1.0], rewards=[0.0], eval_rewards=[])
    assert main(["runs", "plot", "a-1", "nope", "--root", str(tmp_path)]) == 2
    assert "no run 'nope'" in capsys.readouterr().err


def test_runs_plot_draws_ppos_ledger_fields(tmp_path, capsys):
    """PPO's ledger (training/objectives/ppo.py ``ledger_fields``): the value loss, explained variance
    and value clip fraction on the critic's panels, the KL, its coefficient, approx KL and the policy's
    clip fractions on KL and clipping's; explained_variance is null where the returns did not vary."""
    root = tmp_path / "runs"
    run = _write_run(root, "ppo-1", losses=[0.5, 0.4, 0.3], rewards=[0.1, 0.2, 0.3], eval_rewards=[])
    fields = [{"value_loss": 0.9, "explained_variance": None, "value_clip_fraction": 0.0, "kl": 0.0,
               "kl_coef": 0.05, "approx_kl": 1e-9, "clip_fraction": 0.0, "dual_clip_fraction": 0.0,
               "policy_loss": -0.1, "score_min": 0.0, "score_max": 1.0},
              {"value_loss": 0.7, "explained_variance": 0.25, "value_clip_fraction": 0.5, "kl": 0.01,
               "kl_coef": 0.051, "approx_kl": 0.002, "clip_fraction": 0.125, "dual_clip_fraction": 0.0625,
               "policy_loss": -0.2, "score_min": 0.0, "score_max": 1.5},
              {"value_loss": 0.5, "explained_variance": 0.5, "value_clip_fraction": 0.25, "kl": 0.02,
               "kl_coef": 0.052, "approx_kl": 0.004, "clip_fraction": 0.25, "dual_clip_fraction": 0.0,
               "policy_loss": -0.3, "score_min": 0.5, "score_max": 2.0}]
    lines = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    (run / "ledger.jsonl").write_text("".join(json.dumps({**line, **extra}) + "\n" for line, extra in zip(lines, fields)))
    assert main(["runs", "plot", "ppo-1", "--root", str(root)]) == 0
    png = run / "artifacts" / "plots.png"
    assert capsys.readouterr().out.split() == [str(png)]
    drawn = {p["series"]: p for p in json.loads(series_path(png).read_text())["panels"]}
    expected_groups = {"value_loss": "critic", "explained_variance": "critic", "value_clip_fraction": "critic",
                       "kl": "KL and clipping", "kl_coef": "KL and clipping", "approx_kl": "KL and clipping",
                       "clip_fraction": "KL and clipping", "dual_clip_fraction": "KL and clipping",
                       "policy_loss": "loss", "score_min": "rewards and accuracy", "score_max": "rewards and accuracy"}
    for name, group in expected_groups.items():
        assert drawn[name]["group"] == group, name
        values = [[step, f[name]] for step, f in enumerate(fields, start=1) if f[name] is not None]
        assert drawn[name]["lines"] == {"train": values}, name
    assert drawn["explained_variance"]["lines"] == {"train": [[2, 0.25], [3, 0.5]]}  # null: not drawn


def _add_expert_load(run, layers, *, scale=1.0):
    """A mixture of experts' model fields on every ledger line: the balancing loss and, per sparse
    layer i, model/layer<i>_load_min/_load_max and _bias_min/_bias_max (step s, layer i: load
    1 -+ scale * (s + i) / 10, bias -+ 0.01 * s)."""
    lines = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    with open(run / "ledger.jsonl", "w") as f:
        for line in lines:
            step = line["step"]
            fields = {"model/aux/load_balance": 2.0 + 0.1 / step}
            for i in layers:
                spread = scale * (step + i) / 10
                fields.update({f"model/layer{i}_load_min": 1.0 - spread, f"model/layer{i}_load_max": 1.0 + spread,
                               f"model/layer{i}_bias_min": -0.01 * step, f"model/layer{i}_bias_max": 0.01 * step})
            f.write(json.dumps({**line, **fields}) + "\n")


def test_runs_plot_draws_the_expert_load_of_each_layer_on_one_panel(tmp_path, capsys):
    root = tmp_path / "runs"
    run = _write_run(root, "moe-1", losses=[3.0, 2.0], rewards=[0.1, 0.2], eval_rewards=[])
    _add_expert_load(run, layers=(0, 2))
    laid = {name: (group, lines) for group, name, lines in panels(run_series(run))}
    assert not any("layer0" in name for name in laid)  # no panel per layer: one per statistic
    assert laid["model/load_max"] == ("expert load", {"layer0": [(1, 1.1), (2, 1.2)], "layer2": [(1, 1.3), (2, 1.4)]})
    assert laid["model/load_min"][1]["layer2"] == [(1, 0.7), (2, 0.6)]
    assert laid["model/bias_max"][0] == "expert load" and set(laid["model/bias_min"][1]) == {"layer0", "layer2"}
    assert laid["model/aux/load_balance"] == ("expert load", {"train": [(1, 2.1), (2, 2.05)]})

    groups = [group for group, _, _ in panels(run_series(run))]
    assert groups.index("expert load") == groups.index("optimisation") + 1  # drawn after loss and optimisation

    assert main(["runs", "plot", "moe-1", "--root", str(root), "--series", "model/*"]) == 0
    drawn = {p["series"]: p for p in json.loads(series_path(run / "artifacts" / "plots.png").read_text())["panels"]}
    assert drawn["model/load_max"]["lines"] == {"layer0": [[1, 1.1], [2, 1.2]], "layer2": [[1, 1.3], [2, 1.4]]}
    assert len(drawn) == 5 and capsys.readouterr().out.split() == [str(run / "artifacts" / "plots.png")]


def test_many_layers_draw_their_mean_min_max_and_a_comparison_the_worst_layer(tmp_path):
    root = tmp_path / "runs"
    deep = _write_run(root, "deep-1", losses=[3.0, 2.0], rewards=[0.1, 0.2], eval_rewards=[])
    _add_expert_load(deep, layers=range(12))  # more than LIST_ELEMENTS layers
    lines = {name: lines for _, name, lines in panels(run_series(deep))}["model/load_max"]
    assert set(lines) == {"[mean]", "[min]", "[max]"}
    assert lines["[min]"] == [(1, 1.1), (2, 1.2)] and lines["[max]"] == [(1, 1 + 12 / 10), (2, 1 + 13 / 10)]
    assert lines["[mean]"][0][1] == sum(1 + (1 + i) / 10 for i in range(12)) / 12

    shallow = _write_run(root, "shallow-1", losses=[3.0, 2.0], rewards=[0.1, 0.2], eval_rewards=[])
    _add_expert_load(shallow, layers=(0, 1), scale=0.5)
    out = tmp_path / "cmp.png"
    plot_comparison([deep, shallow], out, patterns=["model/*"])  # (the figure alone: no run's own PNG)
    compared = {p["series"]: p["lines"] for p in json.loads(series_path(out).read_text())["panels"]}
    assert compared["model/load_max"] == {"deep-1": [[1, 1 + 12 / 10], [2, 1 + 13 / 10]],
                                          "shallow-1": [[1, 1.1], [2, 1.15]]}  # each run's most loaded layer
    assert compared["model/load_min"]["shallow-1"] == [[1, 0.9], [2, 0.85]]  # ... and least loaded
    assert not any("layer" in name for name in compared)
