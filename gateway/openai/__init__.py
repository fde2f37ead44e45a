"""The OpenAI-compatible API: bodies, model resolution, prompts, generation, response formatting."""
