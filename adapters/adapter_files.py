"""The files that make up a PEFT LoRA adapter and the content digest that names one.

An adapter is exactly two files: `adapter_config.json` (rank, alpha, targets) and
`adapter_model.safetensors` (the LoRA factors). Both decide what the adapter computes, so the content digest
covers both: re-uploading the same weights with a different `lora_alpha` is a new version, and the radix
cache (keyed by adapter name + digest) can never serve KV computed under the old scaling.
"""

from __future__ import annotations

import hashlib

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_README_FILE = "README.md"
# Files an adapter needs, in the order the digest reads them.
REQUIRED_ADAPTER_FILES = (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)
# Pickle-based weight files PEFT and torch can write; loraplex never opens (never unpickles) them.
PICKLE_WEIGHT_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth", "adapter_model.pkl")

_DIGEST_DOMAIN = b"loraplex-adapter-v1\n"


def adapter_digest(config_bytes: bytes, weights_sha256: str) -> str:
    """Hex SHA-256 naming an adapter's content: covers the config bytes and the weights file's SHA-256.

    Semantics: sha256(b"loraplex-adapter-v1\\n" + sha256(config_bytes).hex + "\\n" + weights_sha256 + "\\n").
    The weights are hashed once, by whoever reads them (`sha256_file` or while loading), not twice.
    """
    if not is_sha256_hex(weights_sha256):
        raise ValueError(f"weights_sha256 must be 64 lowercase hex digits, got {weights_sha256!r}")
    h = hashlib.sha256(_DIGEST_DOMAIN)
    h.update(hashlib.sha256(config_bytes).hexdigest().encode() + b"\n")
    h.update(weights_sha256.encode() + b"\n")
    return h.hexdigest()


def is_sha256_hex(value: object) -> bool:
    """True for a 64-character lowercase hex string (what every digest here looks like)."""
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
