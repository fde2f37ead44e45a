"""How a tenant's policy is kept: the fields its operator set (`TenantPolicy.overrides()`) as canonical JSON.

Writes take a TenantPolicy, or a mapping of operator fields that `TenantPolicy.parse` validates (InvalidPolicy,
a ValueError, names the field). Reads go through `read_policy`, the one place a stored policy is validated:
a stored policy that does not validate (written by an older version, or edited by hand in the database)
is logged once at ERROR and read as the default limits, with the problem in `Tenant.policy_error` so
the admin API can show which stored policy is not enforced. Every reader (admission, the admin API,
uploads, the prefix-cache namespace) therefore sees the same TenantPolicy for the same stored text.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Mapping
from typing import Any

from policies.tenant_policy import TenantPolicy

log = logging.getLogger(__name__)


def as_policy(policy: TenantPolicy | Mapping[str, Any] | None) -> TenantPolicy:
    """The TenantPolicy a write stores. Raises InvalidPolicy for a mapping that does not validate."""
    return policy if isinstance(policy, TenantPolicy) else TenantPolicy.parse(policy)


def policy_json(policy: TenantPolicy) -> str:
    """Canonical JSON text of the operator's fields (sorted keys, no spaces)."""
    return json.dumps(policy.overrides(), sort_keys=True, separators=(",", ":"), allow_nan=False)


@functools.lru_cache(maxsize=4096)
def read_policy(tenant_id: str, text: str) -> tuple[TenantPolicy, str | None]:
    """(policy, None) for a stored policy that validates; (the defaults, the problem) for one that does not.

    Cached per (tenant, text): a tenant's reads after the first cost a dict lookup, and an invalid stored
    policy is logged once, not on every request.
    """
    try:
        return TenantPolicy.parse(json.loads(text)), None
    except ValueError as e:  # InvalidPolicy, or text that is not JSON
        problem = f"the stored policy {text} is not enforced ({e}); the default limits apply until it is fixed"
        log.error("tenant %s: %s", tenant_id, problem)
        return TenantPolicy(), problem
