"""The master's inbox: messages from every group's reader thread to the learner, bounded in bytes.

Why bytes and not a message count: one message may be anything up to the frame limit (256 MiB by
default), so 1024 queued messages could hold a quarter of a terabyte. A reader whose message does not
fit waits (its peer's TCP stalls: backpressure), so a group that sends faster than the learner learns
only slows itself down.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Generic, TypeVar

T = TypeVar("T")


class ByteBoundedInbox(Generic[T]):
    """FIFO of (item, size in bytes) holding at most ``max_bytes`` (one item larger than that is let in
    alone, when the inbox is empty, so it cannot wait forever).

    Args:
        max_bytes: the byte budget.
        max_items: a second bound on the number of items (many tiny messages).
    """

    def __init__(self, max_bytes: int, max_items: int = 1024) -> None:
        if max_bytes < 1 or max_items < 1:
            raise ValueError(f"inbox bounds must be >= 1, got {max_bytes} bytes, {max_items} items")
        self.max_bytes = max_bytes
        self.max_items = max_items
        self._items: collections.deque[tuple[T, int]] = collections.deque()
        self._bytes = 0
        self._cond = threading.Condition()

    def put(self, item: T, nbytes: int, timeout: float | None = None) -> bool:
        """Queue ``item``; wait while the budget is spent. False when ``timeout`` (s) passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._items and (self._bytes + nbytes > self.max_bytes or len(self._items) >= self.max_items):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self._items.append((item, nbytes))
            self._bytes += nbytes
            self._cond.notify_all()
            return True

    def get(self, timeout: float | None = None) -> T:
        """The oldest item; raises ``queue.Empty`` when none came within ``timeout`` seconds."""
        with self._cond:
            if not self._items and not self._cond.wait_for(lambda: bool(self._items), timeout):
                raise queue.Empty
            item, nbytes = self._items.popleft()
            self._bytes -= nbytes
            self._cond.notify_all()
            return item

    def get_nowait(self) -> T:
        return self.get(timeout=0)

    def qsize(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def nbytes(self) -> int:
        """Bytes queued now."""
        with self._cond:
            return self._bytes
