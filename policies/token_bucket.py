"""The token bucket both quota backends share (the Redis Lua scripts implement the same arithmetic).

Semantics:
    capacity  C = the per-minute limit;  rate r = C / 60 per second;  a new bucket starts full (level = C).
    refill:   level(now) = min(C, level(ts) + (now - ts) * r)        (time never runs backwards: now >= ts)
    take n:   allowed iff level(now) >= n; then level -= n            (all-or-nothing)
    give n:   level = min(C, level + n)    (reconcile refund);  debt: level may go down to -C on a surcharge
    wait(n):  (n - level) / r seconds until n could be taken (0 if it can now)
    reset:    (C - level) / r seconds until the bucket is full again  (OpenAI's x-ratelimit-reset-*)
    remaining: floor(max(level, 0))

    Hence k requests of cost 1 arriving within a span of d seconds against a full bucket are admitted
    exactly min(k, C + floor(d * r)) times; e.g. 90 requests within 2 s at 30/min: exactly 30.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SECONDS_PER_MINUTE = 60.0


@dataclass
class TokenBucket:
    """Mutable bucket state. `level` and `updated_at` are what the Redis hash stores."""

    capacity: int
    level: float
    updated_at: float

    @classmethod
    def full(cls, capacity: int, now: float) -> TokenBucket:
        if capacity < 1:
            raise ValueError(f"bucket capacity must be >= 1, got {capacity}")
        return cls(capacity=capacity, level=float(capacity), updated_at=now)

    @property
    def rate_per_second(self) -> float:
        return self.capacity / SECONDS_PER_MINUTE

    def refill(self, now: float, capacity: int) -> None:
        """Advance to `now` under a (possibly changed) capacity. Mutates level, updated_at, capacity."""
        self.capacity = capacity
        elapsed = max(0.0, now - self.updated_at)
        self.level = min(float(capacity), self.level + elapsed * self.rate_per_second)
        self.updated_at = max(self.updated_at, now)

    def can_take(self, amount: int) -> bool:
        return self.level >= amount

    def take(self, amount: int) -> None:
        if not self.can_take(amount):
            raise ValueError(f"bucket holds {self.level:.3f}, cannot take {amount}")
        self.level -= amount

    def adjust(self, refund: int) -> None:
        """Give back `refund` (negative = surcharge). Level stays within [-capacity, capacity]."""
        self.level = max(-float(self.capacity), min(float(self.capacity), self.level + refund))

    def wait_seconds(self, amount: int) -> float:
        return max(0.0, (amount - self.level) / self.rate_per_second)

    def reset_seconds(self) -> float:
        return max(0.0, (self.capacity - self.level) / self.rate_per_second)

    def remaining(self) -> int:
        return max(0, math.floor(self.level))
