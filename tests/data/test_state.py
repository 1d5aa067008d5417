"""Data state: JSON form, merging across ranks, refusing incompatible states."""

from __future__ import annotations

import json

import pytest

from core.exceptions import DataError
from data.state import Position, StreamState, merge_states, select_streams, state_dict

COMPAT = {"version": 1, "seq_len": 256, "num_streams": 4, "sources": ["a|1"], "tokenizer": "byte-v1"}


def _states(streams):
    return {s: StreamState((Position(1, 2, 3, 400),), docs=s, skip=1, sequences=10) for s in streams}


def test_state_round_trips_through_json():
    state = state_dict(_states([0, 2]), COMPAT)
    again = json.loads(json.dumps(state))
    assert select_streams(again, [0, 2], COMPAT) == _states([0, 2])


def test_states_of_two_ranks_merge_and_split_for_another_world_size():
    merged = merge_states([state_dict(_states([0, 2]), COMPAT), state_dict(_states([1, 3]), COMPAT)])
    assert list(merged["streams"]) == ["0", "1", "2", "3"]
    assert select_streams(merged, [0, 1, 2, 3], COMPAT) == _states([0, 1, 2, 3])
    with pytest.raises(DataError, match=r"lacks streams \[1\]"):
        select_streams(state_dict(_states([0]), COMPAT), [0, 1], COMPAT)


@pytest.mark.parametrize("key,value", [("seq_len", 512), ("num_streams", 8), ("sources", ["b|2"]),
                                       ("tokenizer", "hf-abc")])
def test_incompatible_state_is_refused_saying_what_differs(key, value):
    state = state_dict(_states([0]), COMPAT)
    with pytest.raises(DataError) as err:
        select_streams(state, [0], {**COMPAT, key: value})
    assert key in str(err.value) and repr(value) in str(err.value)


def test_other_version_is_refused():
    state = state_dict(_states([0]), COMPAT)
    state["version"] = 99
    with pytest.raises(DataError, match="version 99"):
        select_streams(state, [0], COMPAT)
