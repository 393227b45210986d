"""Issue 39, item 3 (its arithmetic): a batch split over shards by their
priority mass is drawn as one table of their union would draw it, and
sampling each shard in turn is not.  Three shards of very different
masses; each shard's own draw is a stratified draw by p^alpha over its
items (what a table does), written here in plain numpy, so the test
checks the composition (shardmath.py), item by item, with a chi-square
test over the union."""

import numpy as np
import pytest

from shmreplay.errors import ReplayError
from shmreplay.ray import shardmath

# the 1e-6 upper quantile of chi-square, by Wilson and Hilferty's
# approximation (within 1% for these degrees of freedom): a correct
# sampler fails it once in a million runs
Z_1E6 = 4.753


def chi2_bound(df: int) -> float:
    return df * (1 - 2 / (9 * df) + Z_1E6 * np.sqrt(2 / (9 * df))) ** 3


def shard_draw(p_alpha: np.ndarray, count: int, rng) -> np.ndarray:
    """A table's stratified draw of ``count`` items of one shard by p^alpha."""
    if count == 0:
        return np.empty(0, np.int64)
    cum = np.cumsum(p_alpha)
    positions = (np.arange(count) + rng.random(count)) * (cum[-1] / count)
    return np.minimum(np.searchsorted(cum, positions, side="right"), p_alpha.size - 1)


def shards():
    rng = np.random.default_rng(39)
    # masses ~ 1 : 30 : 300, sizes 40, 25, 10: a poor shard and two rich ones
    return [rng.uniform(0.01, 0.05, 40), rng.uniform(0.5, 1.9, 25), rng.uniform(20.0, 40.0, 10)]


def tally(counts_of, batches: int = 3000, batch: int = 64, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    parts = shards()
    rng = np.random.default_rng(seed)
    offsets = np.cumsum([0] + [p.size for p in parts[:-1]])
    seen = np.zeros(sum(p.size for p in parts))
    for _ in range(batches):
        for s, count in enumerate(counts_of(np.array([p.sum() for p in parts]), batch, rng)):
            np.add.at(seen, offsets[s] + shard_draw(parts[s], int(count), rng), 1)
    union = np.concatenate(parts)
    return seen, union / union.sum()


def chi2(seen: np.ndarray, p: np.ndarray) -> float:
    expected = seen.sum() * p
    return float(((seen - expected) ** 2 / expected).sum())


def test_a_batch_split_by_mass_is_drawn_as_from_one_table_of_the_union():
    seen, p = tally(shardmath.split)
    assert chi2(seen, p) < chi2_bound(p.size - 1), chi2(seen, p)


def test_sampling_each_shard_in_turn_is_not_the_unions_distribution():
    seen, p = tally(lambda masses, batch, rng: shardmath.in_turn(batch, masses.size))
    assert chi2(seen, p) > 100 * chi2_bound(p.size - 1), chi2(seen, p)


def test_a_shards_count_is_never_two_from_its_share_and_the_batch_is_whole():
    rng = np.random.default_rng(5)
    masses = np.array([0.0, 1e-9, 3.0, 0.25, 700.0])
    for batch in (1, 7, 64, 256):
        for _ in range(500):
            counts = shardmath.split(masses, batch, rng)
            assert counts.sum() == batch and counts[0] == 0  # no mass, no draw
            assert np.all(np.abs(counts - batch * masses / masses.sum()) < 2), counts


def test_weights_are_one_tables_over_the_union():
    parts = shards()
    union = np.concatenate(parts)
    beta = 0.4
    # one table of the union: w_i = (N P(i))^-beta / max_j (N P(j))^-beta
    n, P = union.size, union / union.sum()
    want = (n * P) ** -beta / ((n * P) ** -beta).max()
    got = shardmath.weights(union, sum(p.sum() for p in parts), min(p.min() for p in parts), beta)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(shardmath.probabilities(union, union.sum()), P, rtol=1e-15)


@pytest.mark.parametrize("masses, batch, said", [
    ([0.0, 0.0], 8, "nothing to sample"), ([1.0, -1.0], 8, ">= 0"), ([], 8, "one a shard"),
    ([1.0, np.nan], 8, "finite"), ([1.0], 0, "batch must be"),
])
def test_bad_masses_and_batches_are_refused(masses, batch, said):
    with pytest.raises(ReplayError, match=said):
        shardmath.split(masses, batch, np.random.default_rng(0))
