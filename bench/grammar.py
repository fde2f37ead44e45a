"""Grammar benchmark: compile time per backend (cold and cached), mask fill + apply per step, and the
engine's output tokens/s constrained vs unconstrained on the bench model.

    python -m bench.grammar [--quick] [--corpus-sample N] [--tokenizer DIR] [--out bench/results/grammar.json]

(run it as a module from the repository root: as a script, bench/grammar.py would shadow the
`grammar` package; `pip install -e .[dev,bench]` installs the peers it compares with).

Uses the bench model's tokenizer (bench/.cache/tokenizer-8k, demo.checkpoint.train_tokenizer(dir, "byte_bpe",
8192); the real vocabulary size is printed). Three parts:

- the 20 schemas of tests/grammar/schemas.json: compile cold / cached per backend, mask fill + apply per step
  (xgrammar is timed as an outside reference for the compile call alone);
- the corpus run (bench/grammar_corpus.py): loraplex, llguidance, xgrammar and outlines-core used raw on the
  real-world corpus of tests/grammar/corpus: accepted %, compile p50/p99, mask fill µs per token, and of the
  accepted schemas how many each enforces exactly on generated valid and one-mutation invalid documents;
- the engine's output tokens/s constrained vs unconstrained on the bench model (goal: >= 0.9x at batch 16),
  over the same number of tokens: unconstrained with ignore_eos, constrained by a schema that cannot finish
  before max_tokens (`long_output_schema`).

--quick: fewer mask steps, a 40-schema corpus sample, batch 16 only (64 tokens a request, as the full run).
Prints tables and writes JSON.
Numbers are wall-clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.grammar_corpus import corpus_run, print_summary
from grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    TokenizerInfo,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)

SCHEMAS_FILE = Path(__file__).resolve().parent.parent / "tests" / "grammar" / "schemas.json"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def time_compiles(info: TokenizerInfo, backend: str, schemas: dict[str, dict]) -> dict:
    compiler = GrammarCompiler(info, backend=backend, timeout_s=60)
    cold, cached, refused = [], [], {}
    for name, schema in schemas.items():
        spec = GrammarSpec.json_schema(schema)
        start = time.perf_counter()
        try:
            compiler.compile(spec)
        except GrammarError as e:
            refused[name] = str(e)
            continue
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.compile(spec)
        cached.append(time.perf_counter() - start)
    work = []  # the backend's compile alone, without the thread-pool hop (fresh specs: no cache)
    for schema in schemas.values():
        spec = GrammarSpec.json_schema(schema)
        start = time.perf_counter()
        try:
            compiler.backend.compile(spec)
        except GrammarError:
            continue
        work.append(time.perf_counter() - start)
    compiler.shutdown()
    return {"compiled": len(cold), "refused": refused, "cold_ms": _stats(cold), "cached_ms": _stats(cached),
            "cold_in_thread_ms": _stats(work)}


def time_xgrammar(tokenizer_dir: Path, info: TokenizerInfo, schemas: dict[str, dict]) -> dict:
    try:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        return {"error": f"not installed: {e}"}
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    xinfo = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=info.vocab_size,
                                                    stop_token_ids=list(info.eos_token_ids))
    compiler = xgrammar.GrammarCompiler(xinfo, max_threads=1, cache_enabled=False)
    cold, failed = [], {}
    for name, schema in schemas.items():
        start = time.perf_counter()
        try:
            compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        except Exception as e:  # record and go on: this is an outside reference
            failed[name] = f"{type(e).__name__}: {e}"[:200]
            continue
        cold.append(time.perf_counter() - start)
    return {"compiled": len(cold), "refused": failed, "cold_ms": _stats(cold)}


def _stats(seconds: list[float]) -> dict:
    if not seconds:
        return {}
    ms = [s * 1e3 for s in seconds]
    return {"p50": percentile(ms, 0.5), "p90": percentile(ms, 0.9), "mean": statistics.fmean(ms)}


def time_masks(info: TokenizerInfo, backend: str, schemas: dict[str, dict], batch: int, steps: int) -> dict:
    """Per step: fill `batch` rows in one call + apply to (batch, padded vocab) logits; then sample."""
    compiler = GrammarCompiler(info, backend=backend, timeout_s=60)
    grammars = []
    for schema in schemas.values():
        try:
            grammars.append(compiler.compile(GrammarSpec.json_schema(schema)))
        except GrammarError:
            continue
    matchers = [grammars[i % len(grammars)].matcher() for i in range(batch)]
    bitmask = allocate_bitmask(batch, info.vocab_size)
    padded_vocab = (info.vocab_size + 63) // 64 * 64
    generator = torch.Generator().manual_seed(0)
    rows = list(range(batch))
    fill_s, apply_s = [], []
    for _ in range(steps):
        logits = torch.randn(batch, padded_vocab, generator=generator)  # (batch, V_padded)
        start = time.perf_counter()
        fill_bitmasks(matchers, bitmask, rows)
        middle = time.perf_counter()
        apply_bitmask(logits, bitmask, rows)
        fill_s.append(middle - start)
        apply_s.append(time.perf_counter() - middle)
        tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).flatten().tolist()
        for i, token in enumerate(tokens):
            matchers[i].accept_token(token)
            if matchers[i].is_terminated() or token in info.eos_token_ids:
                matchers[i] = grammars[i % len(grammars)].matcher()
    compiler.shutdown()
    return {"batch": batch, "fill_ms": _stats(fill_s), "apply_ms": _stats(apply_s)}


def long_output_schema(max_tokens: int) -> dict:
    """A JSON schema no output can complete within `max_tokens` tokens: an array of at least `max_tokens`
    small objects, each at least 15 characters (`{"note":"","n":0}`), so more characters than any
    `max_tokens` tokens of the vocabulary spell. A constrained run with it generates exactly as many
    tokens as an unconstrained one with ignore_eos, under the same kind of mask as a real JSON answer."""
    item = {"type": "object", "properties": {"note": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["note", "n"], "additionalProperties": False}
    return {"type": "object", "properties": {"items": {"type": "array", "items": item, "minItems": max_tokens}},
            "required": ["items"], "additionalProperties": False}


def engine_throughput(batch: int, max_tokens: int) -> dict:
    """Output tokens/s of the bench model, constrained (a JSON schema) vs unconstrained, same batch and
    the same number of tokens: the unconstrained requests ignore EOS, the constrained ones follow a schema
    that cannot finish before `max_tokens` (`long_output_schema`), so both run `max_tokens` decode steps
    per request; `*_tokens` and `*_finish` show it (every request ends with "length")."""
    from collections import Counter

    from bench.common import bench_model
    from engine import SamplingParams
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(bench_model()), max_num_seqs=batch, kv_cache_memory_gb=1.0))
    schema = long_output_schema(max_tokens)
    row: dict = {"batch": batch, "max_tokens": max_tokens, "unconstrained_tok_s": 0.0, "constrained_tok_s": 0.0}
    runs = [("warmup", {"ignore_eos": True})] + [("unconstrained", {"ignore_eos": True}),
                                                  ("constrained", {"json_schema": schema})] * 2
    for n, (label, extra) in enumerate(runs):  # interleaved, best of two: the machine may be shared
        for i in range(batch):
            engine.add_request(f"{n}-{i}", {"prompt_token_ids": [100 + i] * 32},
                               SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, **extra))
        tokens, finish, t = 0, Counter(), time.perf_counter()
        while engine.has_unfinished_requests():
            for o in engine.step():
                for s in getattr(o, "samples", ()):
                    tokens += len(s.token_ids)
                    finish[s.finish_reason] += s.finish_reason is not None
        if label != "warmup":
            row[f"{label}_tok_s"] = max(row[f"{label}_tok_s"], tokens / (time.perf_counter() - t))
            row[f"{label}_tokens"], row[f"{label}_finish"] = tokens, {k: v for k, v in finish.items() if v}
    row["ratio"] = row["constrained_tok_s"] / row["unconstrained_tok_s"]
    row["same_tokens"] = row["constrained_tokens"] == row["unconstrained_tokens"] == batch * max_tokens
    return row


def bench_tokenizer() -> Path:
    """bench/.cache/tokenizer-8k (the bench model's), trained there if missing."""
    from bench.common import CACHE
    from demo.checkpoint import train_tokenizer

    tokenizer_dir = CACHE / "tokenizer-8k"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        train_tokenizer(tokenizer_dir, "byte_bpe", 8192)
    return tokenizer_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer mask steps (smoke run)")
    parser.add_argument("--tokenizer", type=Path, help="directory with tokenizer.json (default: the bench model's)")
    parser.add_argument("--corpus-sample", type=int, help="schemas of the corpus run, seeded sample "
                        "(default: all; 40 with --quick; 0 skips it)")
    parser.add_argument("--compile-timeout", type=float, help="per-schema compile limit, s (default 30; 10 with --quick)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "grammar.json")
    args = parser.parse_args()
    schemas = json.loads(SCHEMAS_FILE.read_text())
    sample = args.corpus_sample if args.corpus_sample is not None else (40 if args.quick else None)
    tokenizer_dir = args.tokenizer or bench_tokenizer()
    info = TokenizerInfo.from_file(tokenizer_dir)
    results: dict = {"vocab_size": info.vocab_size, "schemas": len(schemas), "compile": {}, "masks": {}}
    for backend in ("llguidance", "outlines"):
        results["compile"][backend] = time_compiles(info, backend, schemas)
    results["compile"]["xgrammar (reference)"] = time_xgrammar(tokenizer_dir, info, schemas)
    steps = 20 if args.quick else 200
    for backend in ("llguidance", "outlines"):
        results["masks"][backend] = [time_masks(info, backend, schemas, b, steps) for b in (1, 16, 64)]
    if sample != 0:
        results["corpus"] = corpus_run(tokenizer_dir, sample,
                                       compile_timeout_s=args.compile_timeout or (10.0 if args.quick else 30.0))
    print(f"vocab {info.vocab_size}, {len(schemas)} schemas, CPU torch {torch.__version__}")
    print("cold = submit -> result through the thread pool; work = the backend's compile call alone")
    print(f"{'backend':<22}{'compiled':>9}{'cold p50':>10}{'cold p90':>10}{'work p50':>10}{'work p90':>10}"
          f"{'cached p50':>12}{'cached p90':>12}  (ms)")
    nan: dict = {}
    for backend, row in results["compile"].items():
        cold, work, cached = row.get("cold_ms", nan), row.get("cold_in_thread_ms", nan), row.get("cached_ms", nan)
        cells = [cold.get("p50"), cold.get("p90"), work.get("p50"), work.get("p90")]
        print(f"{backend:<22}{row.get('compiled', 0):>9}" + "".join(f"{c if c is not None else float('nan'):>10.3f}" for c in cells)
              + f"{cached.get('p50', float('nan')):>12.4f}{cached.get('p90', float('nan')):>12.4f}")
    print(f"\n{'backend':<14}{'batch':>6}{'fill p50':>10}{'fill p90':>10}{'apply p50':>11}{'apply p90':>11}  (ms/step)")
    for backend, rows in results["masks"].items():
        for row in rows:
            print(f"{backend:<14}{row['batch']:>6}{row['fill_ms']['p50']:>10.3f}{row['fill_ms']['p90']:>10.3f}"
                  f"{row['apply_ms']['p50']:>11.3f}{row['apply_ms']['p90']:>11.3f}")
    if "corpus" in results:
        print_summary(results["corpus"])
    batches = (16,) if args.quick else (1, 16, 64)
    # NOTE: 64 tokens also with --quick: a run of 16 is mostly prefill, and too short to measure on a shared machine
    results["engine"] = [engine_throughput(b, 64) for b in batches]
    print("\noutput tok/s, bench model on CPU: unconstrained (ignore_eos) vs constrained by a JSON schema that cannot"
          "\nfinish before max_tokens, so both generate batch x max_tokens tokens (checked: 'same tokens')")
    print(f"{'batch':>6}{'max_tokens':>11}{'unconstrained tok/s':>22}{'constrained tok/s':>20}{'ratio':>8}"
          f"{'same tokens':>13}")
    for row in results["engine"]:
        print(f"{row['batch']:>6}{row['max_tokens']:>11}{row['unconstrained_tok_s']:>22.1f}"
              f"{row['constrained_tok_s']:>20.1f}{row['ratio']:>8.2f}{str(row['same_tokens']):>13}")
        if not row["same_tokens"]:
            print(f"       tokens: unconstrained {row['unconstrained_tokens']} {row['unconstrained_finish']}, "
                  f"constrained {row['constrained_tokens']} {row['constrained_finish']}: not comparable")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
