"""Grammar fixtures: TokenizerInfo, tokenizers and compilers per tokenizer kind."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from grammar import GrammarCompiler, TokenizerInfo


@pytest.fixture(scope="session")
def tokenizer_infos(tokenizer_dirs: dict[str, Path]) -> dict[str, TokenizerInfo]:
    return {kind: TokenizerInfo.from_file(tokenizer_dirs[kind]) for kind in tokenizer_dirs}


@pytest.fixture(scope="session")
def tokenizers(tokenizer_dirs: dict[str, Path]) -> dict[str, Tokenizer]:
    return {kind: Tokenizer.from_file(str(tokenizer_dirs[kind] / "tokenizer.json")) for kind in tokenizer_dirs}


@pytest.fixture(scope="session")
def compilers(tokenizer_infos: dict[str, TokenizerInfo]):
    """{(kind, backend): GrammarCompiler}, built lazily and shut down at the end."""
    made: dict[tuple[str, str], GrammarCompiler] = {}

    def get(kind: str, backend: str = "llguidance") -> GrammarCompiler:
        if (kind, backend) not in made:
            made[(kind, backend)] = GrammarCompiler(tokenizer_infos[kind], backend=backend, timeout_s=30)
        return made[(kind, backend)]

    yield get
    for compiler in made.values():
        compiler.shutdown()
