"""The real-world corpus (tests/grammar/corpus, see SOURCES.md): acceptance, refusal messages, valid
instances accepted token by token, sampled outputs valid.

The default run checks acceptance on the whole corpus and instances / sampling on a deterministic
sample; `pytest -m long tests/grammar/test_corpus.py` runs instances and sampling over every accepted
schema, one test per schema (`test_full_corpus_schema[source/name]`, so progress and failures are
located; `-k` picks schemas), then `test_full_corpus_generator_coverage` over what they generated. It
takes about an hour on 2 busy cores, so it stays out of the default run. Hypothesis only generates
there (no shrinking: shrinking a Kubernetes-sized instance takes longer than the run).

What dominates a big schema's time is hypothesis-jsonschema itself: `from_schema` inlines every `$ref`
and merges `allOf`s before drawing anything (minutes on a Kubernetes list or a SchemaStore workflow, a
few with no end in sight). It gets GENERATOR_LIMIT_S per schema (env LORAPLEX_CORPUS_GENERATOR_S); past
it the schema counts as "generator: timeout", like a schema the generator cannot handle, and its
instances already drawn are still checked. Our own checks (the key-order search, the 10 sampled
outputs) have no time limit.
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import os
import re
import signal
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import HypothesisException

from grammar import GrammarCompiler, GrammarError, GrammarSpec
from grammar.guard import OutputGuard, schema_validator
from tests.grammar.constrained_sampling import (
    KINDS,
    accepts_in_some_order,
    ascii_class_validator,
    decode,
    hypothesis_jsonschema_compat,
    property_rank,
    sample_constrained,
)

CORPUS_DIR = Path(__file__).parent / "corpus"


def _lines(path: Path) -> list[str]:
    """A corpus file's lines: the sources taken from packages are kept gzipped (.jsonl.gz), the hand-written plain."""
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [line for line in data.decode().split("\n") if line]


CORPUS = [{**entry, "name": f"{entry['source']}/{entry['name']}"}
          for path in sorted([*CORPUS_DIR.glob("*.jsonl"), *CORPUS_DIR.glob("*.jsonl.gz")])
          for entry in (json.loads(line) for line in _lines(path))]
SAMPLE_SIZE = 4  # schemas per default run for instances and sampling (small ones: see _sample)
_POINTED = re.compile(r"^json_schema at #\S*: .+")


def _key(entry: dict) -> str:
    return hashlib.sha256(entry["name"].encode()).hexdigest()


@pytest.fixture(scope="module")
def compiled_corpus(tokenizer_infos):
    """{kind: {name: CompiledGrammar | GrammarError}} for the whole corpus, both tokenizer kinds."""
    results: dict[str, dict] = {}
    for kind in KINDS:
        compiler = GrammarCompiler(tokenizer_infos[kind], timeout_s=60)
        futures = {}
        for entry in CORPUS:
            try:
                futures[entry["name"]] = compiler.submit(GrammarSpec.json_schema(entry["schema"]))
            except GrammarError as e:
                futures[entry["name"]] = e
        results[kind] = {name: f if isinstance(f, GrammarError) else _result(f) for name, f in futures.items()}
        compiler.shutdown()
    return results


def _result(future):
    try:
        return future.result(timeout=120)
    except GrammarError as e:
        return e


def test_corpus_has_300_schemas_from_5_sources():
    assert len(CORPUS) >= 300
    assert len({e["name"] for e in CORPUS}) == len(CORPUS)
    assert len({e["source"] for e in CORPUS}) >= 5


def test_corpus_acceptance_and_refusals(compiled_corpus):
    for kind, results in compiled_corpus.items():
        refused = {name: r for name, r in results.items() if isinstance(r, GrammarError)}
        accepted = len(results) - len(refused)
        assert accepted >= 0.9 * len(results), f"{kind}: {accepted}/{len(results)} accepted"
        by_reason = Counter()
        for name, error in refused.items():
            message = str(error)
            # every refusal names the pointer and the reason (a backend's own refusal is pointed at by
            # grammar/locate.py), or the limit it is over
            assert _POINTED.match(message) or "(GrammarLimits." in message, (name, message)
            # and the place is one in the schema, not the root: none of these is a whole-schema problem
            assert not message.startswith("json_schema at #: "), (name, message)
            by_reason[re.sub(r" at #\S*", "", message)[:60]] += 1
        assert sum(by_reason.values()) == len(refused)


def _sample(compiled_corpus, kind: str, size: int | None) -> list[tuple[dict, object]]:
    accepted = [(e, compiled_corpus[kind][e["name"]]) for e in sorted(CORPUS, key=_key)
                if not isinstance(compiled_corpus[kind][e["name"]], GrammarError)]
    if size is None:
        return accepted
    small = [(e, c) for e, c in accepted if len(json.dumps(e["schema"])) < 20_000]
    return small[:size]


GENERATOR_LIMIT_S = float(os.environ.get("LORAPLEX_CORPUS_GENERATOR_S", "60"))


class _GeneratorTimeout(Exception):
    pass


def _draw_instances(schema: dict, limit_s: float | None) -> tuple[list, str]:
    """(up to 4 instances hypothesis-jsonschema draws for `schema`, derandomized, "ok" or why it stopped:
    "generator: <error>" where it cannot handle the schema, "generator: timeout" past `limit_s`).

    Drawing comes first and checking after, so the time limit (SIGALRM) only ever interrupts the
    generator. The alarm is shared with pytest-timeout's: its handler and remaining time are put back."""
    from hypothesis_jsonschema import from_schema

    drawn: list = []

    def draw() -> str:
        try:
            strategy = from_schema(copy.deepcopy(schema), custom_formats=_UNKNOWN_FORMATS)  # it edits its argument
        except (HypothesisException, Exception) as e:  # noqa: BLE001 - unsupported by the generator, not by us
            return f"generator: {type(e).__name__}"

        @settings(max_examples=4, derandomize=True, deadline=None, database=None, phases=[Phase.generate],
                  report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
        @given(strategy)
        def run(instance):
            drawn.append(copy.deepcopy(instance))

        try:
            run()
        except _GeneratorTimeout:
            raise
        except Exception as e:  # noqa: BLE001 - hypothesis-jsonschema failed to generate (its own limits)
            return f"generator: {type(e).__name__}"
        return "ok"

    def quiet_draw() -> str:
        # NOTE: hypothesis-jsonschema warns (a pattern Python's re cannot read is left out of its strategy;
        # jsonschema's RefResolver is deprecated), and the suite turns warnings into errors: drawing goes
        # on without them, and every instance is still checked against the schema before use.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return draw()

    if limit_s is None:
        return drawn, quiet_draw()

    def on_alarm(signum, frame):
        raise _GeneratorTimeout

    outer_left, _ = signal.getitimer(signal.ITIMER_REAL)
    outer_handler = signal.signal(signal.SIGALRM, on_alarm)
    started = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, min(limit_s, outer_left) if outer_left else limit_s)
    try:
        outcome = quiet_draw()
    except _GeneratorTimeout:
        outcome = "generator: timeout"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer_left - (time.monotonic() - started)))
    return drawn, outcome


def _check_instances(entry: dict, compiled, info, limit_s: float | None = None) -> str:
    """Valid instances from hypothesis-jsonschema are accepted in some key order. Returns "ok", or why
    hypothesis-jsonschema could not generate (all) for this schema (`_draw_instances`); the instances it
    drew before it stopped are checked all the same."""
    instances, outcome = _draw_instances(entry["schema"], limit_s)
    validator = ascii_class_validator(entry["schema"])
    rank = property_rank(entry["schema"])
    for instance in instances:
        if validator.is_valid(instance):  # hypothesis-jsonschema is not exact on every keyword
            assert accepts_in_some_order(compiled, info, instance, key_rank=rank), \
                f"{entry['name']}: {json.dumps(instance)}"
    return outcome


@pytest.fixture(autouse=True)
def _hypothesis_jsonschema_compat():
    with hypothesis_jsonschema_compat():
        yield


def _unknown_formats() -> dict:
    from hypothesis import strategies as st

    return {name: st.text(max_size=8) for name in ("int32", "int64", "byte", "double", "float", "url", "json",
                                                    "simple-template", "template", "media-range", "ipv4-network",
                                                    "ipv6-network", "binary", "password")}


_UNKNOWN_FORMATS = _unknown_formats()


def _check_sampling(entry: dict, compiled, info, tokenizer) -> tuple[int, int]:
    """5 seeds at temperature 1.0: every output that finished is valid, or (only where the grammar
    approximates) caught by the guard. Returns (finished valid, caught by the guard)."""
    guard = OutputGuard(GrammarSpec.json_schema(entry["schema"]))
    validator = schema_validator(entry["schema"])
    approximated = bool(compiled.report and compiled.report.approximations)
    valid = caught = 0
    for seed in range(5):
        ids, finish = sample_constrained(compiled, info, seed, max_tokens=120)
        if finish != "stop":
            continue
        text = decode(tokenizer, info, ids)
        problem = guard.check(text)
        ok = validator.is_valid(json.loads(text))
        assert (problem is None) == ok, (entry["name"], text, problem)
        if ok:
            valid += 1
        else:
            assert approximated, f"{entry['name']}: exact grammar produced an invalid output {text!r}: {problem}"
            caught += 1
    return valid, caught


def _run(compiled_corpus, tokenizer_infos, tokenizers, size):
    generated = Counter()
    finished = caught = 0
    for kind in KINDS:
        for entry, compiled in _sample(compiled_corpus, kind, size):
            if kind == "byte_bpe":
                generated[_check_instances(entry, compiled, tokenizer_infos[kind])] += 1
            ok, bad = _check_sampling(entry, compiled, tokenizer_infos[kind], tokenizers[kind])
            finished += ok
            caught += bad
    assert generated["ok"] >= 0.6 * sum(generated.values()), generated
    assert finished > 0
    return generated, finished, caught


def test_corpus_sample_instances_and_sampling(compiled_corpus, tokenizer_infos, tokenizers):
    _run(compiled_corpus, tokenizer_infos, tokenizers, SAMPLE_SIZE)


# ----- the long run: every accepted schema, one test each ------------------------------------------------

_BY_NAME = {e["name"]: e for e in CORPUS}
_LONG_TALLY: Counter = Counter()  # outcomes of the per-schema tests, for the coverage test after them


@pytest.fixture(scope="module")
def lazy_compilers(tokenizer_infos):
    """{kind: GrammarCompiler} compiling on demand (a -k selection compiles only its schemas), with room
    for a big schema on a loaded machine: a compile over the limit fails the test, it is no refusal."""
    made = {kind: GrammarCompiler(tokenizer_infos[kind], timeout_s=600) for kind in KINDS}
    yield made
    for compiler in made.values():
        compiler.shutdown()


@pytest.mark.long
@pytest.mark.timeout(3600)  # the suite's per-test limit is for the default run
@pytest.mark.parametrize("name", [e["name"] for e in sorted(CORPUS, key=_key)])
def test_full_corpus_schema(name, lazy_compilers, tokenizer_infos, tokenizers):
    """One schema of the corpus, both tokenizer kinds: its hypothesis-jsonschema instances (byte BPE) are
    accepted token by token, and 5 seeds at temperature 1.0 never finish an invalid output."""
    entry = _BY_NAME[name]
    _LONG_TALLY["schemas"] += 1  # ran (passed or not): the coverage test needs every schema's turn
    checked = False
    for kind in KINDS:
        try:
            compiled = lazy_compilers[kind].compile(GrammarSpec.json_schema(entry["schema"]))
        except GrammarError as e:
            assert "compile time limit" not in str(e), (name, kind, str(e))
            continue  # refused: test_corpus_acceptance_and_refusals checks the refusal and the count
        checked = True
        if kind == "byte_bpe":
            _LONG_TALLY[_check_instances(entry, compiled, tokenizer_infos[kind], GENERATOR_LIMIT_S)] += 1
        valid, _ = _check_sampling(entry, compiled, tokenizer_infos[kind], tokenizers[kind])
        _LONG_TALLY["finished valid"] += valid
    if not checked:
        pytest.skip("refused by the grammar compiler")


@pytest.mark.long
def test_full_corpus_generator_coverage():
    """After the per-schema tests (same process): the generator covered most schemas, and sampling
    finished some outputs (else the run checked little)."""
    if _LONG_TALLY["schemas"] < len(CORPUS):
        pytest.skip(f"{_LONG_TALLY['schemas']} of {len(CORPUS)} schemas ran: needs the whole long run, one process")
    generated = {k: v for k, v in _LONG_TALLY.items() if k == "ok" or k.startswith("generator:")}
    print(f"long run: {dict(_LONG_TALLY)}")  # shown with -rA
    assert generated.get("ok", 0) >= 0.6 * sum(generated.values()), generated
    assert _LONG_TALLY["finished valid"] > 0
