"""The corpus run of bench/grammar.py: loraplex and its peers used raw, side by side on the same schemas.

For each schema of tests/grammar/corpus (or a seeded sample of it), and each engine (loraplex, and
llguidance, xgrammar and outlines-core called directly on the schema, without loraplex's normalization):

- accepted: the compile returned within the per-schema time limit without an error;
- compile ms: that cold compile (a fresh schema each time; xgrammar's cache off);
- enforced exactly: up to 3 valid instances from hypothesis-jsonschema (valid by python-jsonschema with
  its format checker) must be accepted token by token in some key order, and up to 6 invalid documents
  (a valid instance with one seeded mutation, invalid by the same validator) must be refused at some
  token. A schema is "exact" when the engine accepted it, at least one document was tried, and none of
  them went the wrong way: no counter-example found, not a proof;
- mask fill µs per token: the engine's mask computation for one sequence, averaged over the tokens of
  the first valid instance it accepted.

Each engine runs in its own process, which is killed and restarted when a schema runs past its time
limit (a native compile cannot be interrupted), so one slow schema costs only its limit.

The peers are set up to follow the specification where they have a setting for it: no flexible
whitespace (documents are fed compact), and xgrammar with `strict_mode=False` (its default forbids every
property or item the schema does not list). What they still refuse of the valid documents is theirs,
checked by hand on the sampled schemas (tools/create_reminder, tools/get_exchange_rates, tools/execute_shell,
events/signup, kubernetes .../horizontalpodautoscalerstatus, cloudformation AWS::EC2::RouteServerPropagation):

- both: a schema with `properties` but no `type` is compiled as object-only, so `null`, `true` or a string
  (valid: `properties` constrains objects only) are refused; most CloudFormation resource schemas are so;
- outlines-core: strings exclude U+007F..U+009F and every control character without a short escape
  (its string regex has no \\uXXXX escape), date-time allows only a 3-digit fraction and `Z` (no
  offsets), and a missing `additionalProperties` is read as false: hypothesis-jsonschema's documents
  have such strings, times and extra keys, so outlines-core is exact on almost no schema;
- xgrammar: bounded numbers (minimum/maximum) take a limited number of fraction digits, so
  1.6432180707861672e-51 under `exclusiveMinimum: 0` is refused in either spelling.
"""

from __future__ import annotations

import copy
import gzip
import json
import multiprocessing as mp
import random
import signal
import statistics
import time
from pathlib import Path
from typing import Any

CORPUS_DIR = Path(__file__).resolve().parent.parent / "tests" / "grammar" / "corpus"
ENGINES = ("loraplex", "llguidance", "xgrammar", "outlines-core")
VALID_PER_SCHEMA = 3
INVALID_PER_SCHEMA = 6


def load_corpus() -> list[dict]:
    """Every corpus entry as {"name": "source/name", "schema": ...}, in file order."""
    entries = []
    for path in sorted([*CORPUS_DIR.glob("*.jsonl"), *CORPUS_DIR.glob("*.jsonl.gz")]):
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        for line in data.decode().split("\n"):
            if line:
                entry = json.loads(line)
                entries.append({"name": f"{entry['source']}/{entry['name']}", "schema": entry["schema"]})
    return entries


# ----- documents: valid instances and one-mutation invalid ones -------------------------------------------

class _Timeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Timeout


def valid_instances(schema: dict, limit_s: float) -> list[Any]:
    """Up to VALID_PER_SCHEMA instances from hypothesis-jsonschema (derandomized) that python-jsonschema
    finds valid (patterns read as ECMA-262 and as Python read them); [] where the generator cannot handle the schema or runs past `limit_s`."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from hypothesis_jsonschema import from_schema

    from tests.grammar.constrained_sampling import ascii_class_validator, hypothesis_jsonschema_compat

    validator = ascii_class_validator(schema)  # valid also with \d, \w read as ECMA-262 reads them
    found: list[Any] = []
    formats = {name: st.text(max_size=8) for name in ("int32", "int64", "byte", "double", "float", "url", "json",
                                                      "binary", "password")}
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        with hypothesis_jsonschema_compat():
            strategy = from_schema(copy.deepcopy(schema), custom_formats=formats)  # NOTE: it edits its argument

            @settings(max_examples=VALID_PER_SCHEMA * 2, derandomize=True, deadline=None, database=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            @given(strategy)
            def collect(instance):
                if len(found) < VALID_PER_SCHEMA and validator.is_valid(instance) and instance not in found:
                    found.append(instance)

            collect()
    except (_Timeout, Exception):  # noqa: BLE001 - the generator's own limits: keep what it found
        pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return found


def _paths(value: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            out += _paths(child, path + (key,))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            out += _paths(child, path + (i,))
    return out


def _variants(value: Any) -> list[Any]:
    """Replacements for one node, each aimed at some keyword: type, enum/const, bounds, multipleOf,
    pattern/format, uniqueItems, required, additionalProperties, dependencies."""
    out: list[Any] = [None, True, "x", 0, 1.5, [], {}]
    if isinstance(value, bool):
        out.append(not value)
    elif isinstance(value, int | float):
        out += [value + 1, value - 1, value + 0.5, -value - 1, value * 1000 + 7, 2**53]
    elif isinstance(value, str):
        out += ["", value + "x", value[:-1], value * 40, value.upper() + "!", " " + value, "a\u00e9\u4e2d"]
    elif isinstance(value, list):
        out += [value + value, value[:-1], value + [value[0]] if value else [None], value[1:] + value[:1]]
    elif isinstance(value, dict):
        for key in value:
            out.append({k: v for k, v in value.items() if k != key})
        out.append({**value, "zz_unknown": 1})
    return out


def invalid_documents(schema: dict, instances: list[Any], seed: int) -> list[Any]:
    """Up to INVALID_PER_SCHEMA documents, each a valid instance with one node replaced, that
    python-jsonschema (format checker on) finds invalid. Seeded."""
    from grammar.guard import schema_validator

    validator = schema_validator(schema)
    rng = random.Random(seed)
    found: list[Any] = []
    for _ in range(40):
        if not instances or len(found) >= INVALID_PER_SCHEMA:
            break
        base = rng.choice(instances)
        path = rng.choice(_paths(base))
        doc = copy.deepcopy(base)
        parent, node = None, doc
        for step in path:
            parent, node = node, node[step]
        replacement = rng.choice(_variants(node))
        if parent is None:
            doc = replacement
        else:
            parent[path[-1]] = replacement
        try:
            invalid = not validator.is_valid(doc)
        except Exception:  # noqa: BLE001 - e.g. a pattern the validator cannot run on this string
            continue
        if invalid and doc not in found:
            found.append(doc)
    return found


# ----- engines, used raw (loraplex through its compiler) --------------------------------------------------

class _LLGuidanceRaw:
    """llguidance's LLMatcher with the matcher interface the key-order search uses."""

    def __init__(self, matcher, eos: int) -> None:
        self._m = matcher

    def accept_token(self, token: int) -> bool:
        return not self._m.is_stopped() and self._m.validate_tokens([token]) == 1 and self._m.consume_token(token)

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def fill_bitmask(self, bitmask, row: int) -> None:
        self._m.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.shape[1] * 4)


class _XGrammarRaw:
    def __init__(self, matcher, eos: int) -> None:
        self._m = matcher

    def accept_token(self, token: int) -> bool:
        return self._m.accept_token(token)

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)

    def is_accepting(self) -> bool:
        return self._m.is_completed()

    def fill_bitmask(self, bitmask, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)


class _OutlinesRaw:
    def __init__(self, guide, eos: int) -> None:
        self._g = guide

    def accept_token(self, token: int) -> bool:
        try:
            self._g.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def rollback(self, n: int) -> None:
        if n:
            self._g.rollback_state(n)

    def is_accepting(self) -> bool:
        return self._g.is_finished()

    def fill_bitmask(self, bitmask, row: int) -> None:
        self._g.write_mask_into(bitmask[row].data_ptr(), bitmask.shape[1], bitmask.element_size())


class _Compiled:
    """What the search needs from a compiled grammar: `matcher()`."""

    def __init__(self, make) -> None:
        self.matcher = make


def _engine(name: str, tokenizer_dir: Path, compile_timeout_s: float):
    """(TokenizerInfo, compile(schema) -> an object with .matcher(), raising on refusal, a (1, words)
    bitmask) for engine `name`."""
    from grammar import GrammarCompiler, GrammarSpec, TokenizerInfo, allocate_bitmask

    info = TokenizerInfo.from_file(tokenizer_dir)
    eos = info.eos_token_ids[0]
    buffer = allocate_bitmask(1, info.vocab_size)
    if name == "loraplex":
        compiler = GrammarCompiler(info, timeout_s=compile_timeout_s, cache_size=1)

        def compile_loraplex(schema):
            grammar = compiler.compile(GrammarSpec.json_schema(schema))
            return grammar  # its matchers have the interface the search uses
        return info, compile_loraplex, buffer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    if name == "llguidance":
        import llguidance
        import llguidance.hf

        tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=info.vocab_size, eos_token=eos)

        def compile_llg(schema):
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                    overrides={"whitespace_flexible": False})
            template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ValueError(template.get_error())
            return _Compiled(lambda: _LLGuidanceRaw(template.deep_copy(), eos))
        return info, compile_llg, buffer
    if name == "xgrammar":
        import xgrammar

        xinfo = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=info.vocab_size, stop_token_ids=[eos])
        xcompiler = xgrammar.GrammarCompiler(xinfo, max_threads=1, cache_enabled=False)

        def compile_xgr(schema):
            # NOTE: strict_mode=False: xgrammar's default (True) forbids every property and item the schema
            # does not list, as if unevaluatedProperties/Items were false, against the specification
            grammar = xcompiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                                    strict_mode=False)
            return _Compiled(lambda: _XGrammarRaw(xgrammar.GrammarMatcher(grammar), eos))
        return info, compile_xgr, buffer
    if name == "outlines-core":
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        by_bytes: dict[bytes, list[int]] = {}
        for token_id, piece in enumerate(info.token_bytes):
            if piece:
                by_bytes.setdefault(piece, []).append(token_id)
        vocabulary = outlines_core.Vocabulary(eos, by_bytes)

        def compile_outlines(schema):
            index = outlines_core.Index(build_regex_from_schema(json.dumps(schema)), vocabulary)
            return _Compiled(lambda: _OutlinesRaw(outlines_core.Guide(index, max_rollback=4096), eos))
        return info, compile_outlines, buffer
    raise ValueError(f"unknown engine {name!r}")


def _check(info, compiled: _Compiled, buffer, valid: list, invalid: list, rank: dict[str, int]) -> dict:
    from tests.grammar.constrained_sampling import accepted_text, greedy_ids

    row: dict = {"valid": len(valid), "valid_accepted": 0, "invalid": len(invalid), "invalid_accepted": 0,
                 "search_over_budget": 0}
    walk = None
    for instance in valid:
        try:
            text = accepted_text(compiled, info, instance, budget=200_000, key_rank=rank)
        except (AssertionError, RecursionError):
            row["search_over_budget"] += 1
            continue
        if text is not None:
            row["valid_accepted"] += 1
            walk = walk or text
    for doc in invalid:
        try:
            row["invalid_accepted"] += accepted_text(compiled, info, doc, budget=200_000, key_rank=rank) is not None
        except (AssertionError, RecursionError):
            row["search_over_budget"] += 1
    if walk is not None:
        matcher, ids, spent = compiled.matcher(), greedy_ids(info, walk), 0.0
        for token in ids:
            start = time.perf_counter()
            matcher.fill_bitmask(buffer, 0)
            spent += time.perf_counter() - start
            matcher.accept_token(token)
        row["fill_us_per_token"] = spent / len(ids) * 1e6
    return row


def _worker(name: str, tokenizer_dir: Path, compile_timeout_s: float, conn) -> None:
    """One engine's process: for each (schema, valid, invalid) received, compile it and check it."""
    import torch

    from tests.grammar.constrained_sampling import property_rank

    torch.set_num_threads(1)
    info, compile_fn, buffer = _engine(name, tokenizer_dir, compile_timeout_s)
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            return
        schema, valid, invalid = job
        start = time.perf_counter()
        try:
            compiled = compile_fn(schema)
        except Exception as e:  # noqa: BLE001 - a refusal, whatever the engine raises
            conn.send({"accepted": False, "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        row = {"accepted": True, "compile_ms": (time.perf_counter() - start) * 1e3}
        # loraplex compiles the canonical (key-sorted) schema; the peers compile the document as written
        row.update(_check(info, compiled, buffer, valid, invalid, property_rank(schema, canonical=name == "loraplex")))
        conn.send(row)


class _EngineProcess:
    def __init__(self, name: str, tokenizer_dir: Path, compile_timeout_s: float) -> None:
        self.args = (name, tokenizer_dir, compile_timeout_s)
        self.process = None
        self.conn = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker, args=(*self.args, child), daemon=True)
        self.process.start()
        if not self.conn.poll(300):
            raise RuntimeError(f"engine {self.args[0]} did not start")
        self.conn.recv()

    def run(self, job: tuple, limit_s: float) -> dict:
        if self.process is None:
            self._start()
        self.conn.send(job)
        if self.conn.poll(limit_s):
            try:
                return self.conn.recv()
            except EOFError:
                pass
        self.stop(kill=True)
        return {"accepted": False, "error": f"timeout: no result within {limit_s:g} s (compile and checks)"}

    def stop(self, kill: bool = False) -> None:
        if self.process is None:
            return
        if kill:
            self.process.kill()
        else:
            self.conn.send(None)
        self.process.join(10)
        self.process = self.conn = None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def corpus_run(tokenizer_dir: Path, sample: int | None, seed: int = 0, compile_timeout_s: float = 30.0,
               generate_limit_s: float = 10.0, engines: tuple[str, ...] = ENGINES) -> dict:
    """Run every engine over the corpus (or `sample` schemas of it, seeded). Returns the summary per
    engine and the per-schema rows."""
    corpus = load_corpus()
    if sample is not None and sample < len(corpus):
        corpus = random.Random(seed).sample(corpus, sample)
    documents = []
    for i, entry in enumerate(corpus):
        valid = valid_instances(entry["schema"], generate_limit_s)
        documents.append((valid, invalid_documents(entry["schema"], valid, seed + i)))
    per_schema: dict[str, dict] = {e["name"]: {} for e in corpus}
    for name in engines:
        process = _EngineProcess(name, tokenizer_dir, compile_timeout_s)
        for entry, (valid, invalid) in zip(corpus, documents, strict=True):
            # the limit covers the compile and the checks (Python searches: seconds)
            per_schema[entry["name"]][name] = process.run((entry["schema"], valid, invalid), compile_timeout_s + 30)
        process.stop()
    return {"schemas": len(corpus), "with_documents": sum(1 for v, _ in documents if v),
            "valid_documents": sum(len(v) for v, _ in documents),
            "invalid_documents": sum(len(i) for _, i in documents),
            "summary": {name: summarize([rows[name] for rows in per_schema.values()]) for name in engines},
            "per_schema": per_schema}


def summarize(rows: list[dict]) -> dict:
    accepted = [r for r in rows if r.get("accepted")]
    tried = [r for r in accepted if r["valid"] + r["invalid"] > 0]
    refuses_valid = [r for r in tried if r["valid_accepted"] < r["valid"] - r["search_over_budget"]]
    leaks = [r for r in tried if r["invalid_accepted"] > 0]
    exact = [r for r in tried if r not in refuses_valid and r not in leaks and r["search_over_budget"] == 0]
    compile_ms = [r["compile_ms"] for r in accepted]
    fill = [r["fill_us_per_token"] for r in accepted if "fill_us_per_token" in r]
    return {
        "accepted": len(accepted), "of": len(rows), "accepted_pct": 100.0 * len(accepted) / max(1, len(rows)),
        "timeouts": sum(1 for r in rows if str(r.get("error", "")).startswith("timeout")),
        "compile_ms_p50": _percentile(compile_ms, 0.5), "compile_ms_p99": _percentile(compile_ms, 0.99),
        "fill_us_per_token_mean": statistics.fmean(fill) if fill else float("nan"),
        "fill_us_per_token_p50": _percentile(fill, 0.5),
        "tried": len(tried), "exact": len(exact), "false_refusals": len(refuses_valid), "leaks": len(leaks),
        "valid_refused_docs": sum(r["valid"] - r["valid_accepted"] for r in tried),
        "invalid_accepted_docs": sum(r["invalid_accepted"] for r in tried),
    }


def print_summary(result: dict) -> None:
    print(f"\ncorpus: {result['schemas']} schemas; {result['with_documents']} with generated documents "
          f"({result['valid_documents']} valid, {result['invalid_documents']} invalid by one mutation)")
    print(f"{'engine':<15}{'accepted':>13}{'compile p50':>13}{'p99':>10}{'fill µs/tok':>13}"
          f"{'tried':>7}{'exact':>7}{'false-refuse':>14}{'leaks':>7}")
    for name, s in result["summary"].items():
        print(f"{name:<15}{s['accepted']:>5}/{s['of']:<3}{s['accepted_pct']:>4.0f}%{s['compile_ms_p50']:>11.2f}ms"
              f"{s['compile_ms_p99']:>8.0f}ms{s['fill_us_per_token_mean']:>13.1f}{s['tried']:>7}{s['exact']:>7}"
              f"{s['false_refusals']:>14}{s['leaks']:>7}")
    print("exact = accepted, >=1 document tried, every valid one accepted and every invalid one refused "
          "(no counter-example found); leaks = schemas with an invalid document accepted")
    print("peers' false refusals are their own gaps (bench/grammar_corpus.py notes them): both read a schema "
          "without `type` as object-only;\noutlines-core has no \\u escapes nor U+007F..U+009F in strings, "
          "date-time without offsets, missing additionalProperties as false")
