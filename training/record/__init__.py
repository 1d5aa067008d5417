"""What a run records and how it is checked again: the ledger (ledger.py), the recorder that
appends a step's line or compares it during a replay (recorder.py), and replay (replay.py)."""
