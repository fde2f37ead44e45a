"""HTTP plumbing of the gateway: OpenAI-shaped errors and pure ASGI middleware."""
