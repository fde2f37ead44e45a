"""Tokenizers, chat templates and incremental detokenization, torch-free (gateway and worker both use them)."""
