"""What a slot lease writes into: the table as mapped now.

``LeaseBinding`` owns the state a lease gets from its table handle, not
from the daemon's reservations: the daemon's id for the table, its field
views (a dict, and a list in field order), the live words whose epoch must
still be the one the lease's slots were reserved under, and ``add_one``'s
kernel bound to those views (``addone.OneAdd``).  The handle binds it
(through ``SlotLease.bind``) when the table is mapped, again after every
reconnect; the lease's reservation state (``lease.SlotLease``: the
current and next reservation, slots handed out) is not its business.

One thread at a time, the lease's (the client's).
"""

from __future__ import annotations

from ..errors import DaemonUnavailable
from .addone import OneAdd


class LeaseBinding:
    __slots__ = ("name", "table_id", "views", "view_list", "words", "epoch", "one")

    def __init__(self, table_name: str):
        self.name = table_name
        self.table_id = 0
        self.views: dict = {}      # the table's field arrays, as mapped now
        self.view_list: list = []  # the same in field order
        self.words = None          # the table's live words (wire.livewords.LiveWords)
        self.epoch = None          # the epoch they must still show for the slots to be ours
        self.one = OneAdd()        # add_one's kernel, bound with the views

    def bind(self, table_id: int, views: dict, view_list: list, words, epoch: int) -> None:
        """The table as mapped now: the daemon's id for it, its field views
        (a dict, and a list in field order), and its live words with the
        epoch they must still show for a lease's slots to be its own."""
        self.table_id = table_id
        self.views = views
        self.view_list = view_list
        self.one.bind(view_list, words)
        self.words, self.epoch = words, epoch

    def current(self) -> bool:
        """Are slots leased under this binding still ours (no daemon
        restarted and took the table over since)?"""
        return self.words.epoch == self.epoch

    def check(self) -> None:
        """``current``, or raise what a writer whose leases died sees."""
        if self.words.epoch != self.epoch:
            raise DaemonUnavailable(f"table {self.name!r} was taken over by a restarted daemon; "
                                    "this client's slot leases died with the old one")
