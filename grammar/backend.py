"""The small interface every grammar backend implements, and the limits it compiles under.

A backend turns a `GrammarSpec` into a `CompiledGrammar` (immutable, cached, shared by requests);
each request gets its own `GrammarMatcher` from it. Backends differ in which JSON-schema keywords
they enforce: `unsupported_keywords` lists the ones a backend would silently ignore (found by
experiment), and grammar/normalize.py rewrites or refuses them up front.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from grammar.spec import GrammarSpec
from grammar.tokenizer_info import TokenizerInfo

if TYPE_CHECKING:
    from grammar.guard import OutputGuard
    from grammar.normalize import NormalizeReport


@dataclass(frozen=True)
class GrammarLimits:
    """Size limits a compile must stay within (the time limit belongs to GrammarCompiler).

    max_spec_chars: longest canonical spec text accepted (sized for Kubernetes and SchemaStore schemas,
        whose descriptions make up most of their text).
    max_schema_nodes: most subschemas in one schema document.
    max_ref_depth: deepest chain of nested $ref targets being expanded.
    max_dependencies: most dependencies / dependentRequired / dependentSchemas entries on one object
        (each rewrite doubles that object's grammar).
    max_one_of_overlaps: most branches of a oneOf whose branches may overlap (each branch is then
        conjoined with the negation of the others: quadratic).
    max_states: largest automaton (outlines-core: index states; llguidance: lexer states).
    max_grammar_symbols: largest context-free grammar (llguidance only).
    step_lexer_fuel: lexer work one token's mask may take (llguidance only; a unit is about 100 ns, and
        the states it builds are kept, so a state costs it once). llguidance's own 200,000 runs out on
        corpus patterns such as an unanchored `.{1,320}` over a long key, and an exhausted lexer fails
        the grammar for good (see CompiledGrammar.broken).
    """

    max_spec_chars: int = 2_000_000
    max_schema_nodes: int = 100_000
    max_ref_depth: int = 32
    max_dependencies: int = 8
    max_one_of_overlaps: int = 16
    max_states: int = 200_000
    max_grammar_symbols: int = 2_000_000
    step_lexer_fuel: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("max_spec_chars", "max_schema_nodes", "max_ref_depth", "max_dependencies", "max_one_of_overlaps", "max_states",
                     "max_grammar_symbols", "step_lexer_fuel"):
            if getattr(self, name) < 1:
                raise ValueError(f"GrammarLimits.{name} must be >= 1, got {getattr(self, name)}")


# The most tokens a matcher can roll back (outlines-core keeps that many prior states per matcher).
MAX_ROLLBACK = 4096


class GrammarMatcher(ABC):
    """One request's position in a compiled grammar. Not thread-safe: one owner at a time.

    Contract: EOS ids are allowed exactly when `is_accepting()`; special tokens never are.
    Accepting EOS terminates the matcher. `accept_token` returns False (and leaves the state
    unchanged) for a token the grammar does not allow.
    """

    backend: GrammarBackend  # the backend that compiled it (batched fills group by it)
    grammar: CompiledGrammar  # what it was made from (its output guard checks the finished text)

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the token is not allowed here."""

    @abstractmethod
    def is_accepting(self) -> bool:
        """The text so far is a complete match (EOS would be allowed now)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Nothing may follow: EOS was accepted, or the match is complete and only EOS is allowed.
        The engine finishes such a request with "stop"."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (an accepted EOS counts as one), at most
        MAX_ROLLBACK of them; for searches over continuations (speculative drafts, tests)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits into bitmask[row] (int32, CPU, (batch, ceil(vocab/32))).
        Bit j of word w is token 32*w + j. Does not change the matcher."""


class CompiledGrammar(ABC):
    """An immutable compiled grammar, safe to share between requests and threads."""

    spec: GrammarSpec
    backend: GrammarBackend
    # NOTE: set by GrammarCompiler before the grammar is published (returned or cached), never after.
    guard: OutputGuard | None = None  # validates finished outputs against `spec`
    report: NormalizeReport | None = None  # what normalizing the schema dropped, rewrote or approximated
    # NOTE: set (once, by a matcher) when the grammar can no longer serve: llguidance's matchers of one
    # grammar share its lexer, and one that runs out of lexer fuel leaves it failed for every matcher
    # made after. GrammarCompiler drops a broken grammar from its cache and compiles it again.
    broken: str | None = None

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar (cheap: no compilation)."""


class GrammarBackend(ABC):
    """Compiles specs over one tokenizer's vocabulary."""

    name: str
    # JSON-schema keywords this backend would silently ignore: refused before compiling.
    unsupported_keywords: frozenset[str]
    # formats it enforces for {"type": "string", "format": ...}
    supported_formats: frozenset[str]
    # of those, the ones it only approximates (the output guard checks them exactly)
    approximate_formats: frozenset[str] = frozenset()
    # whether a $ref may (indirectly) refer to itself
    supports_recursive_ref: bool

    def __init__(self, tokenizer_info: TokenizerInfo, limits: GrammarLimits) -> None:
        self.tokenizer_info = tokenizer_info
        self.limits = limits

    @abstractmethod
    def compile(self, spec: GrammarSpec, schema: dict | None = None) -> CompiledGrammar:
        """Compile `spec`; for a json_schema spec, `schema` is its normalized form (grammar/normalize.py) to
        compile instead of the spec's own text. Raises GrammarError. Thread-safe."""

    def too_large(self, schema: dict) -> bool:
        """Whether this backend refuses the (normalized) `schema` for its size: grammar/locate.py asks it of
        subschemas to point a size refusal at the part that is too large. Backends with such a limit
        override this."""
        return False

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                      rows: Sequence[int]) -> None:
        """Fill bitmask[rows[i]] for matchers[i], all of this backend. Backends override this
        with a parallel fill where they have one."""
        for matcher, row in zip(matchers, rows, strict=True):
            matcher.fill_bitmask(bitmask, row)
