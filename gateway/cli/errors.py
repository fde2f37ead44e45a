"""The one error type of the `loraplex` commands."""

from __future__ import annotations


class CommandError(Exception):
    """A problem the operator can fix; printed without a traceback."""
