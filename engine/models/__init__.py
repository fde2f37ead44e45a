"""Model implementations. Llama-family (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3) share one module."""
