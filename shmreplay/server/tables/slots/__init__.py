"""A table's slot books: which slot is free, reserved, committed or held.

``ledger.py`` (``SlotLedger``: the slot life cycle, the free list, and a
durable table's side of it) with ``slotqueue.py`` (the free list),
``reservations.py`` (writers' reservations: whose slots, committed how
far, how much other users may hold), ``orphans.py`` (slots a dead
daemon's writers leased) and ``barrier.py`` (a durable table's reuse
barrier); ``holds.py`` (``Holds``: slots kept for learners reading them,
and pins) with ``pinbooks.py`` (the caps on pins).

May import: ``wire`` and the shared root modules; never ``select/`` nor
the table above.  Engine thread only, like the table that owns them.
"""
