"""Lockstep's data layer: sources, tokenizers, the pipeline and its state.

Importing ``data`` stays cheap (no torch): worker processes import the stage modules
only. ``data.pipeline.build`` is the entry point the trainer uses.
"""
