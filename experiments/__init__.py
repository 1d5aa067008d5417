"""Experiment tracking: metric/event schemas, cross-rank aggregation, sinks, artifacts, runs.

Imports only ``core``. Submodules are imported explicitly (``experiments.tracking``...) so
the run browser (``python -m experiments runs ...``) starts without importing torch.
"""
