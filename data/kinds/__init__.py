"""The built-in record kinds, one row a module (data/record_kinds.py; preference pairs: data/preference.py)."""
