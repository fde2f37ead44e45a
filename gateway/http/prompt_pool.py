"""The prompt pool: chat-template rendering and tokenization, off the event loop and bounded.

    await pool.run(tenant_id, fn, *args)   fn(*args) in a worker thread; its result or its exception

At most `threads` calls run at once (an anyio CapacityLimiter of its own, apart from the default thread
pool the store calls use), and at most `per_tenant` of them for one tenant: a tenant sending huge prompts
waits behind its own calls and leaves the other threads to everyone else. Callers wait in arrival order.
The tokenizer releases the GIL while it encodes (tokenization/tokenizer.py), so the event loop keeps
answering meanwhile; the template's rendering is Python and shares the GIL in the interpreter's time slices.

NOTE: a call that has started runs to its end even when the request is cancelled (a thread cannot be
interrupted); admission charged the request before it got here, and `per_tenant` bounds what one
tenant's abandoned calls can hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")


class PromptPool:
    def __init__(self, threads: int, per_tenant: int | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self.per_tenant = max(1, threads // 2) if per_tenant is None else per_tenant
        if not 1 <= self.per_tenant <= threads:
            raise ValueError(f"per_tenant must lie in [1, {threads}], got {self.per_tenant}")
        self._limiter: anyio.CapacityLimiter | None = None  # made on first use, inside the event loop
        self._tenants: dict[str, tuple[anyio.Semaphore, list[int]]] = {}  # semaphore, [callers]

    async def run(self, tenant_id: str, fn: Callable[..., T], *args: object) -> T:
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.threads)
        semaphore, callers = self._tenants.setdefault(tenant_id, (anyio.Semaphore(self.per_tenant), [0]))
        callers[0] += 1
        try:
            async with semaphore:
                return await anyio.to_thread.run_sync(fn, *args, limiter=self._limiter)
        finally:
            callers[0] -= 1
            if not callers[0]:
                del self._tenants[tenant_id]

    def busy(self) -> int:
        """Calls running in threads now."""
        return 0 if self._limiter is None else int(self._limiter.borrowed_tokens)
