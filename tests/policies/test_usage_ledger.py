"""SqliteUsageLedger: durable per-(tenant, period) counters."""

from __future__ import annotations

from policies.usage_ledger import SqliteUsageLedger


def test_adds_accumulate_and_survive_reopening(tmp_path):
    path = tmp_path / "sub" / "usage.sqlite"
    ledger = SqliteUsageLedger(path)
    assert ledger.tokens("a", "d:2025-01-01") == 0
    ledger.add("a", "d:2025-01-01", 500)
    ledger.add("a", "d:2025-01-01", -120)
    ledger.add("b", "d:2025-01-01", 7)
    ledger.close()
    reopened = SqliteUsageLedger(path)
    assert reopened.tokens("a", "d:2025-01-01") == 380
    assert reopened.tokens("b", "d:2025-01-01") == 7
    assert reopened.tokens("a", "m:2025-01") == 0
    reopened.close()
