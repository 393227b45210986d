"""Sampling statistics through a real daemon: frequencies, probabilities, weights."""

import math

import numpy as np
import pytest

FIELDS = {"id": ("int64", ())}


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z = 3.719 is p = 1e-4."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def fill(client, name, priorities, alpha, sampler="prioritized"):
    n = len(priorities)
    t = client.create_table(name, capacity=n, fields=FIELDS, sampler=sampler, alpha=alpha)
    t.insert_batch({"id": np.arange(n)}, priorities=np.asarray(priorities, float))
    t.flush()
    return t


@pytest.mark.parametrize("alpha", [0.6, 1.0, 0.0])
def test_sampled_frequencies_match_priority_to_the_alpha(client, alpha):
    rng = np.random.default_rng(7)
    prios = rng.uniform(0.05, 5.0, size=40)
    t = fill(client, f"chi{int(alpha * 10)}", prios, alpha)
    counts = np.zeros(40)
    draws = 0
    for _ in range(200):
        b = t.sample(250)
        counts += np.bincount(b.data["id"], minlength=40)
        draws += 250
    expected = prios**alpha / np.sum(prios**alpha) * draws
    stat = np.sum((counts - expected) ** 2 / expected)
    assert stat < chi2_critical(39), f"chi-square {stat:.1f} for alpha {alpha}"
    # and the test has teeth: the same counts do not fit a wrong alpha
    wrong = prios ** (alpha + 0.5) / np.sum(prios ** (alpha + 0.5)) * draws
    assert np.sum((counts - wrong) ** 2 / wrong) > chi2_critical(39)


def test_uniform_sampler_ignores_priorities(client):
    t = fill(client, "uni", np.linspace(0.0, 100.0, 30), 0.6, sampler="uniform")
    counts = np.zeros(30)
    for _ in range(100):
        b = t.sample(300)
        counts += np.bincount(b.data["id"], minlength=30)
        np.testing.assert_allclose(b.probabilities, 1 / 30)
        np.testing.assert_allclose(b.weights, 1.0)
    expected = counts.sum() / 30
    assert np.sum((counts - expected) ** 2 / expected) < chi2_critical(29)


def test_probabilities_and_importance_weights_follow_the_formula(client):
    alpha, beta = 0.6, 0.4
    prios = np.array([0.5, 1.0, 2.0, 4.0, 8.0, 0.25, 3.0, 1.5])
    t = fill(client, "w", prios, alpha)
    b = t.sample(64, beta=beta)
    ids = b.data["id"]
    p = prios**alpha / np.sum(prios**alpha)
    np.testing.assert_allclose(b.probabilities, p[ids], rtol=1e-12)
    n = len(prios)
    w = (n * p[ids]) ** -beta / ((n * p.min()) ** -beta)  # PER: w_i / max_j w_j
    np.testing.assert_allclose(b.weights, w, rtol=1e-12)
    assert b.weights.max() <= 1.0 + 1e-12


def test_zero_priority_is_never_sampled_even_with_alpha_zero(client):
    prios = np.zeros(50)
    prios[[3, 17, 42]] = [1.0, 2.0, 0.5]
    for alpha in (0.0, 0.7):
        t = fill(client, f"z{int(alpha * 10)}", prios, alpha)
        ids = np.concatenate([t.sample(999).data["id"] for _ in range(20)])
        assert set(ids.tolist()) == {3, 17, 42}


def test_weights_are_normalised_by_the_smallest_positive_priority(client):
    prios = np.array([0.0, 2.0, 8.0])  # the zero item must not drive the weights to infinity
    t = fill(client, "norm", prios, 1.0)
    b = t.sample(100, beta=1.0)
    assert np.all(np.isfinite(b.weights))
    np.testing.assert_allclose(b.weights[b.data["id"] == 1], 1.0)
    np.testing.assert_allclose(b.weights[b.data["id"] == 2], 0.25)


def test_sampling_an_empty_table_without_waiting_raises(client):
    import shmreplay
    t = client.create_table("empty", capacity=10, fields=FIELDS)
    with pytest.raises(shmreplay.EmptyTable, match="no sampleable items"):
        t.sample(4, timeout=0)
    t.insert(id=1, priority=0.0)
    t.flush()
    with pytest.raises(shmreplay.EmptyTable, match="1 committed"):
        t.sample(4, timeout=0.2)
