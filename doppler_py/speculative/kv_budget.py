"""The GPU memory that the KV caches of generations running at once may take together (`load(kv_budget_mb=...)`,
`serve --kv-budget-mb`).

A generation's cache is allocated whole when it starts (its prompt, max_tokens and the drafts' room, `KVCache`), so
the budget is checked once, before the allocation: a generation whose cache does not fit beside the running ones
waits until enough of them have ended and freed theirs; one that could never fit is refused at once
(`CapacityError`, a 400 from the server). Waiting happens before the engine takes the GPU, so the generations that
run keep stepping (and batching) meanwhile. Without a budget, memory is the device's to refuse.
"""

from __future__ import annotations

import threading

from doppler_py.errors import CapacityError


class KVBudget:
    """Bytes of KV cache (and recurrent state) reserved by running generations, at most `limit` in all."""

    def __init__(self, limit: int):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ValueError(f"a KV budget must be a positive number of bytes, got {limit!r}")
        self.limit = limit
        self.reserved = 0
        self.waiting = 0  # generations waiting for room now
        self.waited = 0  # generations that had to wait, since the start
        self._room = threading.Condition()

    def reserve(self, nbytes: int) -> None:
        """Take `nbytes`, waiting while the running generations hold too much of the budget."""
        if nbytes > self.limit:
            raise CapacityError(
                f"this generation's KV cache needs {nbytes / 2**20:.1f} MiB, more than the whole KV budget of "
                f"{self.limit / 2**20:.1f} MiB; ask for fewer tokens or raise the budget (kv_budget_mb)"
            )
        with self._room:
            if self.reserved + nbytes > self.limit:
                self.waiting += 1
                self.waited += 1
                try:
                    self._room.wait_for(lambda: self.reserved + nbytes <= self.limit)
                finally:
                    self.waiting -= 1
            self.reserved += nbytes

    def release(self, nbytes: int) -> None:
        with self._room:
            self.reserved -= nbytes
            self._room.notify_all()
