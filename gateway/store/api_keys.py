"""API key material: `lpx-` + 256 bits from `secrets`, stored only as a sha256 hash, shown once."""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_SCHEME = "lpx-"
PREFIX_LENGTH = len(KEY_SCHEME) + 8  # what listings show: "lpx-" and 8 characters
MAX_KEY_LENGTH = 256  # longer bearer tokens are rejected before hashing


def generate_api_key() -> tuple[str, str, str]:
    """A fresh key: (plaintext, prefix, hash). Only prefix and hash may be stored.

    sha256 without salt or stretching is enough here: the key has 256 bits of entropy, so there is
    nothing for a dictionary attack to guess, and a fast hash keeps lookup per request cheap.
    """
    plaintext = KEY_SCHEME + secrets.token_urlsafe(32)
    return plaintext, plaintext[:PREFIX_LENGTH], hash_api_key(plaintext)


def hash_api_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def looks_like_api_key(plaintext: str) -> bool:
    """Cheap shape check that spares the store a lookup for obvious garbage."""
    return (
        isinstance(plaintext, str)
        and plaintext.startswith(KEY_SCHEME)
        and len(KEY_SCHEME) < len(plaintext) <= MAX_KEY_LENGTH
    )


def hashes_match(stored_hash: str, presented_hash: str) -> bool:
    """Constant-time comparison, so response timing says nothing about how much of a hash matched."""
    return hmac.compare_digest(stored_hash.encode("ascii"), presented_hash.encode("ascii"))
