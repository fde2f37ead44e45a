"""API-key authentication: the Starlette backend and its short-lived lookup cache."""
