"""Streams and ranks, unit assignment per epoch, and the deterministic mixture."""

from __future__ import annotations

from collections import Counter

import pytest

from core.exceptions import ConfigError
from data.sharding import Mixture, StreamAssignment, owned_streams
from data.sources.base import Unit


def _units(n: int) -> list[Unit]:
    return [Unit(f"s{i}", f"s{i}", 0, 0, 1, "json") for i in range(n)]


def test_rank_r_runs_the_streams_congruent_to_r():
    assert owned_streams(8, 1, 4) == [1, 5]
    assert sorted(s for r in range(2) for s in owned_streams(8, r, 2)) == list(range(8))
    with pytest.raises(ConfigError, match="not divisible"):
        owned_streams(8, 0, 3)


def test_each_epoch_gives_every_unit_to_exactly_one_stream():
    asg = StreamAssignment(_units(11), seed=3, source_index=0, num_streams=4, shuffle=True)
    for epoch in range(3):
        got = [u.shard for s in range(4) for u in asg.units(s, epoch)]
        assert sorted(got) == sorted(u.shard for u in _units(11))
    assert asg.units(0, 0) != asg.units(0, 1) or asg.units(1, 0) != asg.units(1, 1)


def test_order_depends_on_seed_and_not_on_shuffle_off():
    a = StreamAssignment(_units(20), seed=1, source_index=0, num_streams=2, shuffle=True)
    b = StreamAssignment(_units(20), seed=2, source_index=0, num_streams=2, shuffle=True)
    c = StreamAssignment(_units(20), seed=1, source_index=0, num_streams=2, shuffle=False)
    assert a.units(0, 0) != b.units(0, 0)
    assert [u.shard for u in c.units(1, 5)] == [f"s{i}" for i in range(1, 20, 2)]


def test_fewer_units_than_streams_are_repeated_so_every_stream_reads():
    asg = StreamAssignment(_units(3), seed=0, source_index=0, num_streams=8, shuffle=True)
    assert all(len(asg.units(s, 0)) == 1 for s in range(8))


def test_mixture_is_a_function_of_seed_stream_and_counter_with_the_right_weights():
    mix = Mixture([2.0, 1.0], seed=5)
    draws = [mix.choose(3, c) for c in range(6000)]
    assert draws == [Mixture([2.0, 1.0], seed=5).choose(3, c) for c in range(6000)]
    assert abs(Counter(draws)[0] / 6000 - 2 / 3) < 0.03
    assert draws != [mix.choose(4, c) for c in range(6000)]
    assert Mixture([1.0], seed=5).choose(0, 17) == 0
