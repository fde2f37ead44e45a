"""API key material: format, entropy, hashing, constant-time comparison."""

from __future__ import annotations

import hashlib

from gateway.store.api_keys import generate_api_key, hash_api_key, hashes_match, looks_like_api_key


def test_generated_keys_have_the_scheme_prefix_and_hash() -> None:
    plaintext, prefix, digest = generate_api_key()
    assert plaintext.startswith("lpx-") and len(plaintext) - 4 >= 43  # 32 bytes, base64url
    assert prefix == plaintext[:12] and digest == hashlib.sha256(plaintext.encode()).hexdigest()
    assert hash_api_key(plaintext) == digest and looks_like_api_key(plaintext)


def test_generated_keys_do_not_repeat() -> None:
    keys = {generate_api_key()[0] for _ in range(500)}
    assert len(keys) == 500
    assert len({k[:12] for k in keys}) > 490  # prefixes are for people, and nearly always distinct


def test_shape_check_and_comparison() -> None:
    assert not looks_like_api_key("sk-abc") and not looks_like_api_key("lpx-")
    assert not looks_like_api_key("lpx-" + "a" * 300) and not looks_like_api_key(None)  # type: ignore[arg-type]
    digest = hash_api_key("lpx-one")
    assert hashes_match(digest, hash_api_key("lpx-one")) and not hashes_match(digest, hash_api_key("lpx-two"))
