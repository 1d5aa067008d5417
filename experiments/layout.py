"""Names inside a run directory (design.md section 4), shared by writers and readers."""

from __future__ import annotations

CONFIG_FILE = "config.yaml"
META_FILE = "meta.json"
LEDGER_FILE = "ledger.jsonl"
METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"
LOCK_FILE = ".lock"
LOGS_DIR = "logs"
CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "LATEST"
DIAGNOSTICS_DIR = "diagnostics"
ARTIFACTS_DIR = "artifacts"
TENSORBOARD_DIR = "tensorboard"
TRACES_DIR = "traces"
PLOTS_FILE = "plots.png"
