"""The scheduler's waiting queue, in the order a scheduling policy gives it.

``fcfs`` (first come, first served): requests in arrival order, a preempted request back at the front.
``priority``: by the request's ``priority`` (lower first), then by arrival; a preempted request goes back to
its place by the same order, as vLLM's priority policy does. Both are plain Python over requests: the
scheduler's unit tests run them in milliseconds.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from splitserve.engine.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


def priority_key(request: Request) -> tuple[int, int]:
    """The priority policy's order: priority (lower first), then arrival (the engine's request number)."""
    return request.priority, request.arrival_number


class RequestQueue:
    """Waiting requests in arrival order (``fcfs``); :class:`PriorityRequestQueue` keeps them in priority order."""

    def __init__(self) -> None:
        self._requests: deque[Request] | list[Request] = deque()

    def add(self, request: Request) -> None:
        """A request that arrives (or whose KV arrived): behind the others."""
        self._requests.append(request)

    def prepend(self, request: Request) -> None:
        """A preempted request: first, so that it resumes before newer ones start."""
        self._requests.appendleft(request)

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        return self._requests.popleft()

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]


class PriorityRequestQueue(RequestQueue):
    """Waiting requests by :func:`priority_key`: a preempted request goes back by its key too."""

    def __init__(self) -> None:
        self._requests: list[Request] = []  # kept sorted by priority_key

    def add(self, request: Request) -> None:
        bisect.insort(self._requests, request, key=priority_key)

    prepend = add

    def pop(self) -> Request:
        return self._requests.pop(0)


def request_queue(policy: str) -> RequestQueue:
    """An empty waiting queue for ``policy`` (one of :data:`SCHEDULING_POLICIES`)."""
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}.")
    return PriorityRequestQueue() if policy == "priority" else RequestQueue()
