"""The daemon's frame books (``shmreplay/server/tables/frames/``) against
their plain reference model (``tests/frames_reference.py``), bit for bit:
every count, every free queue in order, every item's references, after
every step of random runs of leases, commits (good and bad references),
removals under each remover and under ``max_times_sampled``, owners gone
and adoption.  And the invariant itself, checked apart from the model: no
frame a live item references is ever free or handed to a lease.

The removals are chosen here by each remover's rule (the oldest, the
newest, a random item; or an item's N-th sample): the books are not
joined to a table's selection yet (docs/frames.md, what is left)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frames_reference import FramesModel
from shmreplay.errors import CapacityError, FieldError, ReplayError
from shmreplay.fields import parse_fields
from shmreplay.framespec import frame_capacity, parse_frames
from shmreplay.server.tables.frames.book import FrameBook

FIELDS = parse_fields({"obs": ("uint8", (3, 2, 2)), "next_obs": ("uint8", (3, 2, 2)),
                       "depth": ("float32", (2, 2)), "reward": ("float32", ())})
FRAMES = parse_frames({"obs": 3, "next_obs": "obs", "depth": 2}, FIELDS)
COL_RING = [0] * 6 + [1] * 2  # obs's 3 and next_obs's 3 in ring 0, depth's 2 in ring 1
CAPACITY = 10
MAX_TIMES = 2


def book_and_model():
    book = FrameBook(FRAMES, CAPACITY)
    assert list(book.col_ring) == COL_RING and book.size == frame_capacity(CAPACITY) == 74
    return book, FramesModel(2, book.size, COL_RING)


def check_same(book, model):
    assert book.queues.count.tolist() == model.counts()
    for r in range(2):
        assert book.queues.queue(r).tolist() == list(model.free[r])
    for slot, refs in model.items.items():
        assert book.refs[slot].tolist() == refs
    assert book.leases.held() == sum(len(fs) for _, _, fs in model.leases.values())


def check_invariant(book, model):
    """Apart from the model's counts: a live item's frames and a lease's
    frames are never in a free queue, and every frame is either held or
    queued once."""
    for r in range(2):
        queued = book.queues.queue(r).tolist()
        assert len(queued) == len(set(queued))
        held = {f for refs in model.items.values() for j, f in enumerate(refs) if COL_RING[j] == r}
        held |= {f for _, ring, fs in model.leases.values() if ring == r for f in fs}
        assert not held & set(queued)
        assert held | set(queued) == set(range(book.size))


def pick_refs(data, model, owner):
    refs = []
    for ring in COL_RING:
        own = [f for o, r, fs in model.leases.values() if o == owner and r == ring for f in fs]
        live = [f for refs_ in model.items.values() for j, f in enumerate(refs_) if COL_RING[j] == ring]
        kind = data.draw(st.sampled_from(["own", "live", "any"] if own or live else ["any"]))
        pool = {"own": own, "live": live}.get(kind) or []
        refs.append(data.draw(st.sampled_from(pool)) if pool else
                    data.draw(st.integers(0, model.size + 2)))
    return refs


def removal(data, model, remover, order):
    live = [s for s in order if s in model.items]
    if remover == "fifo":
        return live[0]
    if remover == "lifo":
        return live[-1]
    return data.draw(st.sampled_from(live))


@pytest.mark.parametrize("remover", ["fifo", "lifo", "uniform", "max_times_sampled"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_books_agree_with_the_model_and_keep_every_live_items_frames(remover, data):
    book, model = book_and_model()
    order: list[int] = []  # slots in commit order
    times: dict[int, int] = {}
    steps = data.draw(st.integers(1, 60))
    for _ in range(steps):
        op = data.draw(st.sampled_from(["lease", "lease", "commit", "commit", "commit", "give_back",
                                        "sample", "release_owner", "adopt"]))
        owner = data.draw(st.integers(1, 3))
        if op == "lease":
            ring, n = data.draw(st.integers(0, 1)), data.draw(st.integers(1, 12))
            live = {f for refs in model.items.values() for j, f in enumerate(refs) if COL_RING[j] == ring}
            want = model.lease(owner, ring, n, book.leases.cap_per_owner)
            if want is None:
                with pytest.raises(CapacityError, match="give back the frame leases"):
                    book.lease(owner, ring, n)
            else:
                lid, frames = book.lease(owner, ring, n)
                assert (lid, frames.tolist()) == want
                assert not live & set(want[1])  # nothing a live item references is handed out
        elif op == "give_back":
            mine = sorted(lid for lid, (o, _, _) in model.leases.items() if o == owner)
            lid = data.draw(st.sampled_from(mine)) if mine and data.draw(st.booleans()) else \
                data.draw(st.integers(0, model.next_lease + 1))
            want = model.give_back(owner, lid)
            if want is None:
                with pytest.raises(ReplayError, match="not one of yours"):
                    book.give_back(owner, lid)
            else:
                assert book.give_back(owner, lid) == want
        elif op == "commit":
            if len(model.items) == CAPACITY:  # full: the remover's item leaves first
                slot = removal(data, model, "uniform" if remover == "max_times_sampled" else remover, order)
                assert book.remove(slot) == model.remove(slot)
            slot = data.draw(st.sampled_from([s for s in range(CAPACITY) if s not in model.items]))
            refs = pick_refs(data, model, owner)
            bad = model.commit(slot, refs)
            row = np.asarray(refs, dtype=np.uint32)
            if bad < 0:
                book.commit(slot, row)
                order = [s for s in order if s != slot] + [slot]
                times[slot] = 0
            else:
                name = ("obs", "next_obs", "depth")[0 if bad < 3 else 1 if bad < 6 else 2]
                with pytest.raises(FieldError, match=f"field '{name}'"):
                    book.commit(slot, row)
        elif op == "sample" and remover == "max_times_sampled" and model.items:
            slot = data.draw(st.sampled_from(sorted(model.items)))
            times[slot] += 1
            if times[slot] == MAX_TIMES:
                assert book.remove(slot) == model.remove(slot)
        elif op == "release_owner":
            assert book.release_owner(owner) == model.release_owner(owner)
        elif op == "adopt":
            live = np.zeros(CAPACITY, dtype=bool)
            live[list(model.items)] = True
            assert book.adopt(live) == 0
            model.adopt()
        check_same(book, model)
        check_invariant(book, model)


def test_a_reference_nobody_holds_is_refused_and_nothing_is_counted():
    book, _ = book_and_model()
    lid, frames = book.lease(1, 0, 6)
    _, depth_frames = book.lease(1, 1, 2)
    before = book.queues.count.copy()
    row = np.asarray([*frames[:5], 70, *depth_frames], dtype=np.uint32)  # 70: free, nobody's
    with pytest.raises(FieldError, match=r"field 'next_obs', frame 2 of the stack: reference 70"):
        book.commit(0, row)
    assert (book.queues.count == before).all()
    row[5] = 74  # past the ring (74 frames)
    with pytest.raises(FieldError, match="reference 74"):
        book.commit(0, row)
    row[5] = frames[5]
    book.commit(0, row)
    assert book.queues.count[frames].tolist() == [2, 2, 2, 2, 2, 2]
    book.give_back(1, lid)
    assert book.queues.count[frames].tolist() == [1] * 6  # the live item keeps them
    assert book.remove(0) == 6 + 0  # ring 0's six; ring 1's two are still leased
    assert book.free(0) == book.size and book.free(1) == book.size - 2


def test_an_item_that_references_one_frame_four_times_holds_it_until_it_leaves():
    """gymnasium's reset padding: the first frame repeated."""
    fields = parse_fields({"obs": ("uint8", (4, 2, 2))})
    book = FrameBook(parse_frames({"obs": 4}, fields), 4)
    lid, (f,) = book.lease(7, 0, 1)
    book.commit(2, np.asarray([f, f, f, f], dtype=np.uint32))
    book.give_back(7, lid)
    assert book.queues.count[f] == 4 and f not in book.queues.queue(0)
    assert book.remove(2) == 1 and book.queues.queue(0)[-1] == f


def test_an_owner_is_capped_and_the_rest_stay_for_others():
    book, _ = book_and_model()
    cap = book.leases.cap_per_owner
    assert cap == (74 - CAPACITY) // 2
    _, got = book.lease(1, 0, cap + 5)
    assert got.shape[0] == cap  # at most the cap
    with pytest.raises(CapacityError, match=f"holds {cap} frames .* at most {cap}"):
        book.lease(1, 0, 1)
    _, other = book.lease(2, 0, 5)
    assert other.shape[0] == 5
    assert book.release_owner(1) == cap and book.leases.held(1) == 0


def test_adoption_counts_only_live_items_and_refuses_references_outside_the_ring():
    book, _ = book_and_model()
    book.refs[3] = [1, 2, 3, 2, 3, 4, 0, 1]
    book.refs[5] = [9, 9, 9, 9, 9, 9, 5, 5]
    live = np.zeros(CAPACITY, dtype=bool)
    live[3] = True
    assert book.adopt(live) == 0
    assert book.queues.counts(0)[[1, 2, 3, 4, 9]].tolist() == [1, 2, 2, 1, 0]
    assert book.queues.counts(1)[[0, 1, 5]].tolist() == [1, 1, 0]
    assert book.queues.queue(0).tolist() == [0] + list(range(5, 74))
    book.refs[5, 0] = 74
    live[5] = True
    assert book.adopt(live) == 1  # the caller sets such a table aside
