"""``Table.sample(..., ahead=True)``: the next batch drawn in the daemon
while a one-thread loop steps its env (issue 36, item 1).

What it promises (``client/draws.py``, ``TableDraws.ahead``): the batch a
call returns was drawn when the handle had made half as many insert calls
as between the two ahead samples before it (at once for a learner that
made none), so it lacks the items inserted after that and holds the ones
before; a batch of another size or beta is drawn at the call; a draw that
the table's limits refused when it was sent is drawn again at the call;
the rows are the rows of the keys (gathered and checked at the call); a
forked child draws on its own connection.  Real daemon, real shared
memory; the daemon's ``sample_calls`` counts the SAMPLEs it answered.
"""

import os

import numpy as np
import pytest

FIELDS = {"x": ("int64", ()), "y": ("int64", ())}


def _insert(t, lo, hi):
    for i in range(lo, hi):
        t.insert(x=i, y=2 * i)


def _paced(t):
    """Items 0..29 in and two ahead samples of 64 made, 10 inserts apart:
    the next is sent at the 5th insert from here."""
    _insert(t, 0, 20)
    t.sample(64, ahead=True)
    _insert(t, 20, 30)
    t.sample(64, ahead=True)
    return t


def _sample_calls(c) -> int:
    c.flush(keep_leases=True)  # every record sent, the SAMPLE too, applied
    return c.stats()["tables"]["t"]["sample_calls"]


def test_the_next_batch_is_sent_halfway_through_the_inserts_between_two_samples(start_daemon):
    d = start_daemon(tables=[{"name": "t", "capacity": 1000, "fields": FIELDS}])
    with d.connect() as c:
        t = c.table("t")
        _insert(t, 0, 100)
        assert _sample_calls(c) == 0
        t.sample(8, ahead=True)  # drawn now; no insert counted yet: the next goes at once
        assert _sample_calls(c) == 2
        _insert(t, 100, 110)
        t.sample(8, ahead=True)  # collects the one sent; 10 inserts: the next after 5
        assert _sample_calls(c) == 2
        _insert(t, 110, 114)
        assert _sample_calls(c) == 2
        _insert(t, 114, 115)
        assert _sample_calls(c) == 3
        _insert(t, 115, 125)  # sent once only
        assert _sample_calls(c) == 3
        t.sample(8, ahead=True)  # 15 inserts this time: the next after 8
        _insert(t, 125, 132)
        assert _sample_calls(c) == 3
        _insert(t, 132, 133)
        assert _sample_calls(c) == 4


def test_a_batch_drawn_ahead_lacks_what_came_after_its_draw_and_holds_what_came_before(start_daemon):
    """64 draws over 30 items: a batch drawn at the call would hold one of
    the 10 newest with probability 1 - (2/3)**64 (all but 1e-11)."""
    d = start_daemon(tables=[{"name": "t", "capacity": 64, "fields": FIELDS}])
    with d.connect() as c:
        t = c.table("t")
        _insert(t, 0, 20)
        t.sample(64, ahead=True)  # the next is sent now, with items 0..19 in
        _insert(t, 20, 30)
        b = t.sample(64, ahead=True)
        assert b.data["x"].max() < 20
        np.testing.assert_array_equal(b.data["y"], 2 * b.data["x"])  # each row whole, its own
        _insert(t, 30, 35)  # the 5th of the 10 sends the next: items 0..34 in
        _insert(t, 35, 40)
        b = t.sample(64, ahead=True)
        assert 20 <= b.data["x"].max() <= 34
        np.testing.assert_array_equal(b.data["y"], 2 * b.data["x"])
        # into an earlier batch's arrays
        _insert(t, 40, 50)
        again = t.sample(64, ahead=True, out=b)
        assert again.data["x"] is b.data["x"] and again.data["x"].max() <= 44


def test_another_size_or_beta_is_drawn_at_the_call_and_a_plain_sample_leaves_the_draw_ahead(start_daemon):
    """Under capacity, nothing evicted: no redraw adds to ``sample_calls``,
    so each call's count says whether it drew now or collected."""
    d = start_daemon(tables=[{"name": "t", "capacity": 64, "fields": FIELDS}])
    with d.connect() as c:
        t = c.table("t")
        _insert(t, 0, 20)
        t.sample(64, ahead=True)  # one of 64 at beta 0.4 sent now
        _insert(t, 20, 30)
        calls = _sample_calls(c)
        b = t.sample(63, ahead=True)  # another size: that one dropped, 63 drawn now
        assert len(b) == 63 and _sample_calls(c) == calls + 1
        _insert(t, 30, 40)  # the 5th sent one of 63 at beta 0.4
        calls = _sample_calls(c)
        b = t.sample(63, ahead=True, beta=0.5)  # another beta: dropped, drawn now
        assert _sample_calls(c) == calls + 1
        _insert(t, 40, 45)  # the 5th sends one of 63 at beta 0.5: items 0..44 in
        calls = _sample_calls(c)
        t.sample(63, beta=0.5)  # a plain sample draws now and leaves that one out
        assert _sample_calls(c) == calls + 1
        _insert(t, 45, 50)
        b = t.sample(63, ahead=True, beta=0.5)  # collects it
        assert _sample_calls(c) == calls + 1
        assert 30 <= b.data["x"].max() <= 44
        np.testing.assert_array_equal(b.data["y"], 2 * b.data["x"])


def test_a_draw_sent_more_inserts_ago_than_the_last_interval_is_drawn_again(start_daemon):
    """A batch drawn ahead lacks at most one interval's inserts: one sent
    longer ago (the program sampled without ``ahead`` for a while) is
    dropped and the call draws now (64 draws over 50 items miss the 15
    newest with probability 1e-10)."""
    with start_daemon(tables=[{"name": "t", "capacity": 64, "fields": FIELDS}]).connect() as c:
        t = _paced(c.table("t"))
        _insert(t, 30, 50)  # sent with 0..34 in, then 15 more
        calls = _sample_calls(c)
        b = t.sample(64, ahead=True)
        assert _sample_calls(c) == calls + 1 and b.data["x"].max() >= 35


def test_a_wrong_out_leaves_the_draw_ahead_for_the_next_call(start_daemon):
    from shmreplay import ReplayError
    with start_daemon(tables=[{"name": "t", "capacity": 64, "fields": FIELDS}]).connect() as c:
        t = _paced(c.table("t"))
        _insert(t, 30, 35)  # the 5th sent one: 0..34 in
        small = t.sample(8)
        with pytest.raises(ReplayError, match="out= holds 8 rows"):
            t.sample(64, ahead=True, out=small)
        calls = _sample_calls(c)
        _insert(t, 35, 40)
        b = t.sample(64, ahead=True)  # the one sent at the 5th, collected
        assert _sample_calls(c) == calls and b.data["x"].max() <= 34


def test_a_draw_the_limits_refused_when_sent_is_drawn_again_at_the_call(start_daemon):
    """Each item may be sampled once.  The draw of 8 sent at the 4th of 8
    inserts finds 4 items and is refused (it may not wait in the daemon);
    the call that collects it draws again, even with ``timeout=0``, the 8
    inserted since the last sample."""
    d = start_daemon(tables=[{"name": "t", "capacity": 100, "fields": FIELDS, "max_times_sampled": 1}])
    with d.connect() as c:
        t = c.table("t")
        _insert(t, 0, 8)
        first = t.sample(8, ahead=True, timeout=30)  # the next, sent now, finds none
        _insert(t, 8, 16)
        second = t.sample(8, ahead=True, timeout=30)  # collects the refusal: drawn now
        got = np.concatenate([first.data["x"], second.data["x"]])
        np.testing.assert_array_equal(np.sort(got), np.arange(16))
        _insert(t, 16, 24)  # the 4th sends a draw of 8 that finds 4
        third = t.sample(8, ahead=True, timeout=0)
        np.testing.assert_array_equal(np.sort(third.data["x"]), np.arange(16, 24))


def test_insert_batch_calls_count_as_one_each(start_daemon):
    d = start_daemon(tables=[{"name": "t", "capacity": 1000, "fields": FIELDS}])
    with d.connect() as c:
        t = c.table("t")

        def batch(lo):
            x = np.arange(lo, lo + 10)
            t.insert_batch({"x": x, "y": 2 * x})

        batch(0)
        t.sample(8, ahead=True)  # sends the next at once
        for lo in (10, 20, 30, 40):
            batch(lo)
        t.sample(8, ahead=True)  # 4 calls (40 items): the next after 2
        calls = _sample_calls(c)
        batch(50)
        assert _sample_calls(c) == calls
        batch(60)
        assert _sample_calls(c) == calls + 1


def test_a_forked_child_draws_on_its_own_connection(start_daemon):
    """The parent's batch sent ahead is its connection's: a child's ahead
    sample draws now on the child's, and the parent still collects its own."""
    d = start_daemon(tables=[{"name": "t", "capacity": 64, "fields": FIELDS}])
    with d.connect() as c:
        t = c.table("t")
        _insert(t, 0, 20)
        t.sample(64, ahead=True)  # sent now, 0..19 in
        _insert(t, 20, 30)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                b = t.sample(64, ahead=True)  # drawn at the call: the newest 10 in
                code = 0 if b.data["x"].max() >= 20 else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        b = t.sample(64, ahead=True)
        assert b.data["x"].max() < 20
