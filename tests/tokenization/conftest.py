"""Tokenizers of each demo chat style (demo/chat_styles.py), made once per session from the trained ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from demo.chat_styles import CHAT_STYLES, with_chat_style


@pytest.fixture(scope="session")
def styled_tokenizer_dirs(tokenizer_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                          ) -> dict[tuple[str, str], Path]:
    """{(tokenizer kind, style): tokenizer dir} for both kinds and every style."""
    root = tmp_path_factory.mktemp("styled-tokenizers")
    return {(kind, style): with_chat_style(src, root / f"{kind}-{style}", style)
            for kind, src in tokenizer_dirs.items() for style in CHAT_STYLES}
