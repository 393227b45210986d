"""The daemon's frame books (``shmreplay/server/tables/frames/``) against
their plain reference model (``tests/frames_reference.py``), bit for bit:
every count, every free queue in order, every slot's references, after
every step of random runs of leases, commits (good and bad references),
slots reserved again under each remover and under ``max_times_sampled``,
owners gone and adoption.  And the invariant itself, checked apart from
the model: no frame a slot's references hold (a live item's, or one that
left while its slot is not reserved again: a learner may still read it)
is ever free or handed to a lease.

The items that leave are chosen here by each remover's rule (the oldest,
the newest, a random item; or an item's N-th sample), over the books
alone; ``test_table_frames.py`` runs them joined to a real table, whose
own remover chooses."""

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
    for slot in range(CAPACITY):
        assert book.refs[slot].tolist() == model.items.get(slot, [0xFFFFFFFF] * 8)
    assert book.leases.held() == sum(len(fs) for _, _, fs in model.leases.values())


def check_invariant(book, model):
    """Apart from the model's counts: frames a slot references and a
    lease's frames are never in a free queue, and every frame is either
    held or queued once."""
    for r in range(2):
        queued = book.queues.queue(r).tolist()
        assert len(queued) == len(set(queued))
        held = {f for refs in model.items.values() for j, f in enumerate(refs) if COL_RING[j] == r}
        held |= {f for _, ring, fs in model.leases.values() if ring == r for f in fs}
        assert not held & set(queued)
        assert held | set(queued) == set(range(book.size))


def pick_refs(data, model, owner):
    """An item's references: frames the owner's leases hold or slots
    reference, ring by ring; in one draw of five, one column anything at
    all (mostly a frame nobody holds, or past the ring)."""
    refs = []
    for ring in COL_RING:
        own = [f for o, r, fs in model.leases.values() if o == owner and r == ring for f in fs]
        held = [f for refs_ in model.items.values() for j, f in enumerate(refs_) if COL_RING[j] == ring]
        pool = own + held
        refs.append(data.draw(st.sampled_from(pool)) if pool else data.draw(st.integers(0, model.size + 2)))
    if data.draw(st.integers(0, 4)) == 0:
        refs[data.draw(st.integers(0, len(refs) - 1))] = data.draw(st.integers(0, model.size + 2))
    return refs


def victim(data, live, remover, order):
    live_in_order = [s for s in order if s in live]
    if remover == "fifo":
        return live_in_order[0]
    if remover == "lifo":
        return live_in_order[-1]
    return data.draw(st.sampled_from(live_in_order))


@pytest.mark.parametrize("remover", ["fifo", "lifo", "uniform", "max_times_sampled"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_books_agree_with_the_model_and_keep_every_slots_frames(remover, data):
    book, model = book_and_model()
    order: list[int] = []  # live slots in commit order
    live: set[int] = set()  # slots with an item in the table (model.items: slots holding references)
    times: dict[int, int] = {}
    steps = data.draw(st.integers(1, 60))
    for _ in range(steps):
        op = data.draw(st.sampled_from(["lease", "lease", "commit", "commit", "commit", "give_back",
                                        "sample", "release_owner", "adopt", "abort"]))
        owner = data.draw(st.integers(1, 3))
        if op == "lease":
            ring, n = data.draw(st.integers(0, 1)), data.draw(st.integers(1, 12))
            held = {f for refs in model.items.values() for j, f in enumerate(refs) if COL_RING[j] == ring}
            want = model.lease(owner, ring, n, book.leases.cap_per_owner)
            if want is None:
                with pytest.raises(CapacityError, match="its writers share that"):
                    book.lease(owner, ring, n)
            else:
                lid, frames = book.lease(owner, ring, n)
                assert (lid, frames.tolist()) == want
                assert not held & set(want[1])  # nothing a slot references is handed out
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
            if len(live) == CAPACITY:  # full: the remover's item leaves, its slot is reserved again
                slot = victim(data, live, "uniform" if remover == "max_times_sampled" else remover, order)
                live.discard(slot)
            else:  # a free slot, which may still hold a sampled-out item's references
                slot = data.draw(st.sampled_from([s for s in range(CAPACITY) if s not in live]))
            assert book.let_go(np.array([slot], dtype=np.int64)) == model.let_go(slot)
            refs = pick_refs(data, model, owner)
            bad = model.commit(slot, refs)
            row = np.asarray(refs, dtype=np.uint32)
            if bad < 0:
                book.commit(slot, row)
                live.add(slot)
                order = [s for s in order if s != slot] + [slot]
                times[slot] = 0
            else:
                name = ("obs", "next_obs", "depth")[0 if bad < 3 else 1 if bad < 6 else 2]
                with pytest.raises(FieldError, match=f"field '{name}'"):
                    book.commit(slot, row)
        elif op == "sample" and remover == "max_times_sampled" and live:
            slot = data.draw(st.sampled_from(sorted(live)))
            times[slot] += 1
            if times[slot] == MAX_TIMES:
                live.discard(slot)  # it leaves; its slot keeps its references until reserved again
        elif op == "abort":
            # a slot reserved again (the remover's item evicted, or a free
            # one) and its reservation aborted: no commit follows
            if live and (len(live) == CAPACITY or data.draw(st.booleans())):
                slot = victim(data, live, "uniform" if remover == "max_times_sampled" else remover, order)
                live.discard(slot)
            else:
                slot = data.draw(st.sampled_from([s for s in range(CAPACITY) if s not in live]))
            assert book.let_go(np.array([slot], dtype=np.int64)) == model.let_go(slot)
        elif op == "release_owner":
            assert book.release_owner(owner) == model.release_owner(owner)
        elif op == "adopt":
            assert book.adopt() == 0
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
    assert (book.refs[0] == 0xFFFFFFFF).all()  # the slot holds nothing: reserving it again lets go of nothing
    row[5] = 74  # past the ring (74 frames)
    with pytest.raises(FieldError, match="reference 74"):
        book.commit(0, row)
    row[5] = frames[5]
    book.commit(0, row)
    assert book.queues.count[frames].tolist() == [2, 2, 2, 2, 2, 2]
    book.give_back(1, lid)
    assert book.queues.count[frames].tolist() == [1] * 6  # the live item keeps them
    assert book.let_go(np.array([0])) == 6 + 0  # ring 0's six; ring 1's two are still leased
    assert book.free(0) == book.size and book.free(1) == book.size - 2


def test_a_slot_that_references_one_frame_four_times_holds_it_until_reserved_again():
    """gymnasium's reset padding: the first frame repeated."""
    fields = parse_fields({"obs": ("uint8", (4, 2, 2))})
    book = FrameBook(parse_frames({"obs": 4}, fields), 4)
    lid, (f,) = book.lease(7, 0, 1)
    book.commit(2, np.asarray([f, f, f, f], dtype=np.uint32))
    book.give_back(7, lid)
    assert book.queues.count[f] == 4 and f not in book.queues.queue(0)
    assert book.let_go(np.array([2])) == 1 and book.queues.queue(0)[-1] == f
    assert book.let_go(np.array([2])) == 0 and book.queues.count[f] == 0  # once only


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


def test_adoption_counts_the_references_slots_hold_and_refuses_what_no_daemon_wrote():
    book, _ = book_and_model()
    book.refs[3] = [1, 2, 3, 2, 3, 4, 0, 1]
    book.refs[5] = [9, 9, 9, 9, 9, 9, 5, 5]
    lid, _ = book.lease(1, 0, 3)
    assert book.adopt() == 0
    assert book.leases.held() == 0  # leases died with the daemon that gave them
    assert book.queues.counts(0)[[1, 2, 3, 4, 9]].tolist() == [1, 2, 2, 1, 6]
    assert book.queues.counts(1)[[0, 1, 5]].tolist() == [1, 1, 2]
    assert book.queues.queue(0).tolist() == [0] + list(range(5, 9)) + list(range(10, 74))
    book.refs[5, 0] = 74  # past the ring
    assert book.adopt() == 1
    book.refs[5, 0] = 0xFFFFFFFF  # a half-marked row
    assert book.adopt() == 7
