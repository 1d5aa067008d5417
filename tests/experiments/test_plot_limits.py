"""``runs plot`` on ledgers a probe found: bytes that are not UTF-8 (a traceback before), 3,000
numeric keys (3,000 panels, over 200 s) and a 256-element list field (256 panels, 103 s). Bad
lines are skipped as ``runs show`` skips them, and said; panels are limited, and what is left
out is said (experiments/plots.py, experiments/__main__.py)."""

from __future__ import annotations

import json

from experiments.__main__ import main


def _run(root, name, records, *, raw_lines=()):
    run = root / name
    run.mkdir(parents=True)
    (run / "meta.json").write_text("{}")
    with open(run / "ledger.jsonl", "wb") as f:
        for record in records:
            f.write(json.dumps(record).encode() + b"\n")
        for line in raw_lines:
            f.write(line)
    return run


def _drawn(run):
    return json.loads((run / "artifacts" / "plots.json").read_text())


def test_a_line_that_is_not_utf8_is_skipped_and_named(tmp_path, capsys):
    run = _run(tmp_path, "r-1", [{"step": 1, "loss": 2.0}],
               raw_lines=[b'{"step": 2, "loss": 1.5, "note": "caf\xe9"}\n', b'{"step": 3, "loss": 1.0}\n'])
    (run / "events.jsonl").write_bytes(b'{"event": "run_started", "time": 1.0, "rank": 0, "run_id": "r-1"}\n'
                                       b'\xff\xfe not text\n')
    assert main(["runs", "plot", "r-1", "--root", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{run / 'ledger.jsonl'} line 2: not UTF-8" in err and f"{run / 'events.jsonl'} line 2: not UTF-8" in err
    drawn = _drawn(run)
    assert [p["lines"] for p in drawn["panels"] if p["series"] == "loss"] == [{"train": [[1, 2.0], [3, 1.0]]}]
    assert drawn["skipped_lines"] == [f"{run / 'ledger.jsonl'} line 2: not UTF-8",
                                      f"{run / 'events.jsonl'} line 2: not UTF-8"]
    # the run browser's other commands read the same files the same way
    assert main(["runs", "list", "--root", str(tmp_path)]) == 0
    assert main(["runs", "show", "r-1", "--root", str(tmp_path)]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_thousands_of_keys_draw_a_limited_number_of_panels_and_name_the_rest(tmp_path, capsys):
    records = [{"step": s, "loss": 1.0 / s, "grad_norm": 0.5, **{f"k{i:04d}": i * s for i in range(3000)}}
               for s in (1, 2)]
    run = _run(tmp_path, "wide-1", records)
    assert main(["runs", "plot", "wide-1", "--root", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "draws 32 of 3002 panels; left out: k0030, k0031" in err and "and 2965 more" in err and "--series" in err
    drawn = _drawn(run)
    names = [p["series"] for p in drawn["panels"]]
    assert len(names) == 32 and names[:2] == ["loss", "grad_norm"]  # display order: loss and optimisation first
    assert len(drawn["left_out"]) == 2970 and not set(names) & set(drawn["left_out"])

    assert main(["runs", "plot", "wide-1", "--root", str(tmp_path), "--series", "k2999", "--series", "lo*"]) == 0
    assert [p["series"] for p in _drawn(run)["panels"]] == ["loss", "k2999"]
    assert capsys.readouterr().err.count("left out") == 1  # the unchosen series are named as left out


def test_a_long_list_field_is_one_panel_of_its_mean_min_and_max(tmp_path):
    run = _run(tmp_path, "lists-1", [{"step": s, "loss": 1.0, "inner_losses": [s + i for i in range(256)],
                                      "short": [s, -s]} for s in (1, 2)])
    assert main(["runs", "plot", "lists-1", "--root", str(tmp_path)]) == 0
    panels = {p["series"]: p["lines"] for p in _drawn(run)["panels"]}
    assert sorted(panels) == ["inner_losses", "loss", "short"]
    assert panels["inner_losses"] == {"[mean]": [[1, 128.5], [2, 129.5]], "[min]": [[1, 1.0], [2, 2.0]],
                                      "[max]": [[1, 256.0], [2, 257.0]]}
    assert panels["short"] == {"[0]": [[1, 1.0], [2, 2.0]], "[1]": [[1, -1.0], [2, -2.0]]}


def test_panel_choices_that_draw_nothing_are_usage_errors(tmp_path, capsys):
    _run(tmp_path, "r-1", [{"step": 1, "loss": 2.0}])
    for args, words in ((["--series", "nope*"], "--series nope* matches no series"),
                        (["--max-panels", "-1"], "--max-panels must be >= 0")):
        assert main(["runs", "plot", "r-1", "--root", str(tmp_path), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and "\n" not in err, err
    assert main(["runs", "plot", "r-1", "--root", str(tmp_path), "--max-panels", "0"]) == 0
