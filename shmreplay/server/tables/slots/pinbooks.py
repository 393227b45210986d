"""How many slots each learner, each user and all capped users pin: the
caps on protected redraws (``holds.py``, ``Holds.pin``).

A client pins at most ``cap`` slots (a quarter of the table); a user other
than root, the daemon's own or the admin group (a *capped* user: the
engine passes its uid, else None) at most ``cap`` over all its clients;
all capped users together at most ``others_cap`` (half).  The same shares
as reservations (``reservations.py``), so one user's learners cannot pin
a table into uselessness.  Entries go when their count reaches zero:
clients come and go for weeks.

Engine thread only, like the holds that own it.
"""

from __future__ import annotations


class PinBooks:
    def __init__(self, capacity: int):
        self.cap = max(1, capacity // 4)
        self.others_cap = max(1, capacity // 2)
        self.of_owner: dict[int, int] = {}   # client -> slots it pins
        self.user_of: dict[int, int] = {}    # client -> its capped user (uncapped clients absent)
        self.of_user: dict[int, int] = {}    # capped user -> slots its clients pin
        self.others = 0                      # slots all capped users' clients pin

    def any(self) -> bool:
        """Whether any slot is pinned (every pin is counted for its owner)."""
        return bool(self.of_owner)

    def admit(self, owner: int, k: int, user: int | None) -> bool:
        """Count k more pinned slots for ``owner`` if no cap is passed."""
        mine = self.of_owner.get(owner, 0)
        if mine + k > self.cap:
            return False
        if user is not None:
            if self.of_user.get(user, 0) + k > self.cap or self.others + k > self.others_cap:
                return False
            self.user_of[owner] = user
            self.of_user[user] = self.of_user.get(user, 0) + k
            self.others += k
        self.of_owner[owner] = mine + k
        return True

    def drop(self, owner: int, k: int) -> None:
        """``owner`` unpinned k slots (a release, an expiry, its lease's end)."""
        user = self.user_of.get(owner)
        if user is not None:
            self.of_user[user] -= k
            self.others -= k
            if not self.of_user[user]:
                del self.of_user[user]
        left = self.of_owner[owner] - k
        if left:
            self.of_owner[owner] = left
        else:
            del self.of_owner[owner]
            self.user_of.pop(owner, None)
