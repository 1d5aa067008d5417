"""Fixtures of the data tests (helpers live in tests/data/corpus.py)."""

from tests.data.corpus import corpus  # noqa: F401  (a fixture)
