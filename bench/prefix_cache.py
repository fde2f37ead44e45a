"""Radix prefix cache on the bench model (printed, not asserted).

(a) requests sharing a 1,024-token system prompt with distinct 32-token questions: TTFT p50 cold (cache
    flushed before each request) vs warm (system prompt cached), and the ratio;
(b) 8 tenants x 4-turn chats replayed turn by turn: prefill tokens computed and throughput with the cache
    on vs off, vs HF transformers (no prefix reuse) on the same requests; plus a 0 % hit-rate workload
    (distinct prompts) to show what the cache costs when it never hits.

    python -m bench.prefix_cache [--quick]     (from the repository root)
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from bench.common import bench_model, percentile, print_table, write_json
from engine import SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine

GREEDY_ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def engine_for(model, caching: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), kv_cache_memory_gb=1.5, enable_prefix_caching=caching,
                                  max_num_batched_tokens=2048))


def run_alone(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams, salt: str = "") -> tuple:
    """(seconds to first token, output token ids, cached tokens) for one request run alone."""
    t = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, params, cache_salt=salt)
    first, tokens, cached = None, [], 0
    while engine.has_unfinished_requests():
        for o in engine.step():  # deltas: this step's new tokens
            first = first or time.perf_counter() - t
            tokens += [tok for s in o.samples for tok in s.token_ids]
            cached = o.num_cached_tokens
    return first, tokens, cached


def shared_system_prompt(model, vocab: int, n_cold: int, n_warm: int) -> list[dict]:
    rng = random.Random(0)
    system = [rng.randrange(10, vocab) for _ in range(1024)]
    questions = [[rng.randrange(10, vocab) for _ in range(32)] for _ in range(max(n_cold, n_warm))]
    engine = engine_for(model, caching=True)
    cold = []
    for i in range(n_cold):
        engine.scheduler.kv.prefix_cache.flush()
        cold.append(run_alone(engine, f"c{i}", system + questions[i], GREEDY_ONE)[0])
    run_alone(engine, "warmup", system + [1, 2, 3], GREEDY_ONE)
    warm = [run_alone(engine, f"w{i}", system + questions[i], GREEDY_ONE)[0] for i in range(n_warm)]
    c50, w50 = percentile(cold, 50), percentile(warm, 50)
    return [{"case": "cold", "requests": n_cold, "ttft_p50_ms": 1000 * c50},
            {"case": "warm", "requests": n_warm, "ttft_p50_ms": 1000 * w50, "cold_over_warm": c50 / w50}]


def chats(vocab: int, tenants: int, turns: int, seed: int = 1) -> list[list[list[int]]]:
    """Per tenant, the prompt of each turn: the history so far plus a new user message."""
    rng = random.Random(seed)
    out = []
    for _ in range(tenants):
        history = [rng.randrange(10, vocab) for _ in range(rng.randint(200, 400))]  # system prompt
        prompts = []
        for _ in range(turns):
            history = history + [rng.randrange(10, vocab) for _ in range(rng.randint(20, 60))]
            prompts.append(list(history))
            history = history + [rng.randrange(10, vocab) for _ in range(32)]  # the assistant's answer
        out.append(prompts)
    return out


def replay(engine: LLMEngine, conversations: list[list[list[int]]], max_tokens: int) -> dict:
    """Turn by turn: every tenant's turn t is submitted together, after all of turn t - 1 finished."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    computed = total = generated = 0
    t = time.perf_counter()
    for turn in range(len(conversations[0])):
        for i, conv in enumerate(conversations):
            engine.add_request(f"t{i}-{turn}", {"prompt_token_ids": conv[turn]}, params, cache_salt=f"tenant-{i}")
        while engine.has_unfinished_requests():
            for o in engine.step():  # deltas: this step's new tokens of each request
                generated += sum(len(s.token_ids) for s in o.samples)
                if o.finished:
                    total += o.num_prompt_tokens
                    computed += o.num_prompt_tokens - o.num_cached_tokens
    wall = time.perf_counter() - t
    return {"prompt_tokens": total, "prefill_tokens_computed": computed, "wall_s": wall,
            "tokens_per_s": (total + generated) / wall}


def replay_hf(model, conversations: list[list[list[int]]], max_tokens: int) -> dict:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    total = generated = 0
    t = time.perf_counter()
    for turn in range(len(conversations[0])):
        for conv in conversations:
            with torch.no_grad():
                hf.generate(torch.tensor([conv[turn]]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                            do_sample=False, pad_token_id=0)
            total += len(conv[turn])
            generated += max_tokens
    wall = time.perf_counter() - t
    return {"prompt_tokens": total, "prefill_tokens_computed": total, "wall_s": wall,
            "tokens_per_s": (total + generated) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    model = bench_model()
    vocab = ModelConfig.from_pretrained(model).vocab_size
    n_cold, n_warm = (3, 8) if args.quick else (6, 16)
    a = shared_system_prompt(model, vocab, n_cold, n_warm)
    print_table("(a) 1,024-token shared system prompt + 32-token question, one request at a time (CPU, fp32)",
                a, ["case", "requests", "ttft_p50_ms", "cold_over_warm"])

    tenants, turns, max_tokens = (4, 3, 8) if args.quick else (8, 4, 16)
    conv = chats(vocab, tenants, turns)
    rows = []
    for caching in (True, False):
        r = replay(engine_for(model, caching), conv, max_tokens)
        rows.append({"system": f"loraplex cache {'on' if caching else 'off'}", **r})
    if not args.skip_hf:
        rows.append({"system": "transformers", **replay_hf(model, conv, max_tokens)})
    total = rows[0]["prompt_tokens"]
    # Tokens a turn repeats from the previous turn's prompt: the most any prefix cache can skip here (the
    # replayed assistant answers are not what the model generated, so they are not cached).
    repeated = sum(len(c[t - 1]) for c in conv for t in range(1, turns))
    print(f"\nrepeated share of prompt tokens: {repeated / total:.3f} (so at best {1 - repeated / total:.3f} "
          "of prompt tokens must be computed)")
    for r in rows:
        r["computed_share"] = r["prefill_tokens_computed"] / total
        r["speedup_vs_off"] = r["tokens_per_s"] / rows[1]["tokens_per_s"]
    print_table(f"(b) {tenants} tenants x {turns}-turn chats replayed turn by turn (CPU, fp32)", rows,
                ["system", "prompt_tokens", "prefill_tokens_computed", "computed_share", "tokens_per_s",
                 "speedup_vs_off", "wall_s"])

    rng = random.Random(7)
    distinct = [[[rng.randrange(10, vocab) for _ in range(300)]] for _ in range(tenants * 2)]
    zero = []
    for caching in (True, False):
        r = replay(engine_for(model, caching), distinct, max_tokens)
        zero.append({"system": f"loraplex cache {'on' if caching else 'off'}", **r})
    zero[0]["cost_vs_off"] = zero[1]["tokens_per_s"] / zero[0]["tokens_per_s"]
    print_table("(c) 0 % hit rate: distinct 300-token prompts (CPU, fp32)", zero,
                ["system", "prefill_tokens_computed", "tokens_per_s", "cost_vs_off", "wall_s"])
    write_json("prefix_cache", {"shared_system_prompt": a, "multi_turn": rows, "zero_hit": zero,
                                "repeated_share": repeated / total,
                                "quick": args.quick})


if __name__ == "__main__":
    main()
