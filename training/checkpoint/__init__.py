"""Checkpoints: the manager that writes and restores them (manager.py), the on-disk format and its
manifest (manifest.py), what a checkpoint captures besides the weights (state.py: RNG, data and
trainer state, host snapshots), and how a run finds the checkpoint to resume from (resume.py)."""
