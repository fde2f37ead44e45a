"""The one error type of the adapter layer."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter (directory, archive or stored copy) that cannot be accepted.

    The message is one line that names the problem (the file, tensor or field at fault), fit to show a tenant.
    """
