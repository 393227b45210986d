"""The dense member set kernels (``members.py``) against their plain-numpy twin."""

from __future__ import annotations

import numpy as np
import pytest

import members_reference as ref
from shmreplay.server.tables.select import members as k
from shmreplay.server.tables.select.samplers import UniformSampler


def check_layout(members: np.ndarray, pos: np.ndarray, count: int, expected: np.ndarray) -> None:
    assert count == expected.shape[0]
    assert np.array_equal(np.sort(members[:count]), expected)
    assert np.array_equal(pos[members[:count]], np.arange(count))  # pos indexes members exactly
    outside = np.ones(pos.shape[0], bool)
    outside[members[:count]] = False
    assert np.all(pos[outside] == -1)


@pytest.mark.parametrize("seed", range(6))
def test_random_adds_and_removes_match_the_twin(seed):
    rng = np.random.default_rng(seed)
    cap = 97
    members, pos, count = np.zeros(cap, np.int64), np.full(cap, -1, np.int64), 0
    current = np.empty(0, np.int64)
    for _ in range(300):
        slots = rng.integers(0, cap, size=int(rng.integers(0, 40)), dtype=np.int64)  # duplicates, members
        if rng.random() < 0.55:
            new = ref.first_new(current, slots)
            before = count
            count = k.members_add(members, pos, count, slots)
            assert np.array_equal(members[before:count], new)  # appended in first-occurrence order
            current = ref.members_add(current, slots)
        else:
            count = k.members_remove(members, pos, count, slots)
            current = ref.members_remove(current, slots)
        check_layout(members, pos, count, current)


def test_remove_everything_and_add_back():
    cap = 10
    members, pos = np.zeros(cap, np.int64), np.full(cap, -1, np.int64)
    everything = np.arange(cap, dtype=np.int64)
    count = k.members_add(members, pos, 0, everything[::-1])
    assert list(members) == list(range(cap - 1, -1, -1))
    count = k.members_remove(members, pos, count, everything)
    check_layout(members, pos, count, np.empty(0, np.int64))
    count = k.members_add(members, pos, count, np.array([3, 3, 7], np.int64))
    check_layout(members, pos, count, np.array([3, 7]))


def test_uniform_sampler_draws_only_members():
    """The sampler on the kernels: draws come from the members left, uniformly enough to hit each."""
    s = UniformSampler(50)
    s.add(np.arange(50, dtype=np.int64), np.ones(50))
    s.remove(np.arange(0, 50, 2))  # any int dtype: the sampler converts
    assert s.mass == 25
    slots, probs, weights = s.pick(5000, np.random.default_rng(0))
    assert set(slots.tolist()) == set(range(1, 50, 2))
    assert np.all(probs == 1 / 25) and np.all(weights == 1)
