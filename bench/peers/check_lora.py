"""Do the peers serve the same adapters? Greedy tokens of llama-server (GGUF LoRA) and loraplex vs peft.

bench/serving_vs_peers.py compares throughput with the same 8 adapters on every server; this checks that
"the same adapters" holds: the PEFT adapters converted by llama.cpp's convert_lora_to_gguf.py, applied
per request by llama-server, and the same PEFT directories loaded by loraplex, against transformers +
peft running each adapter alone (fp32 everywhere, greedy, EOS ignored). It prints, per adapter (and the
base model), how many of the generated tokens agree with peft position by position and writes
bench/results/check_lora.json. Exit status 1 when a system agrees on under --min-agree of the tokens.

    python -m bench.peers.check_lora [--adapters 2] [--prompts 4] [--tokens 16]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import httpx
import torch

from bench.common import bench_model, print_table, write_json
from bench.multi_lora import make_adapters
from bench.peers import llamacpp
from bench.serving_vs_peers import free_port, spawn


def _peft_greedy(model_dir, adapter_dir, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    return out


def _loraplex_greedy(model_dir, adapters, prompts: list[list[int]], tokens: int) -> dict[str, list[list[int]]]:
    from engine import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", num_kv_blocks=256, max_loras=max(1, len(adapters)), max_lora_rank=64)
    names: list[str | None] = [None]
    for i, path in enumerate(adapters):
        llm.load_adapter(f"a{i}", path)
        names.append(f"a{i}")
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    result = {}
    for name in names:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapters=[name] * len(prompts))
        result[name or "base"] = [o.outputs[0].token_ids for o in outs]
    return result


def _llama_server_greedy(model_dir, adapters, prompts: list[list[int]], tokens: int,
                         threads: int) -> dict[str, list[list[int]]]:
    gguf = llamacpp.convert_model(model_dir, "F32")
    loras = [llamacpp.convert_adapter(a, model_dir) for a in adapters]
    port = free_port()
    proc = spawn("llama-server", llamacpp.server_command(gguf, port, 1, 1024, threads, loras))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("llama-server did not become ready")
            time.sleep(0.5)
        result = {}
        for index, name in [(None, "base")] + [(i, f"a{i}") for i in range(len(adapters))]:
            rows = []
            for prompt in prompts:
                body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                        "cache_prompt": False, "return_tokens": True,
                        "lora": [{"id": j, "scale": 1.0 if j == index else 0.0} for j in range(len(adapters))]}
                resp = httpx.post(url + "/completion", json=body, timeout=600)
                resp.raise_for_status()
                rows.append(resp.json()["tokens"])
            result[name] = rows
        return result
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _agreement(got: list[list[int]], want: list[list[int]]) -> float:
    same = total = 0
    for g, w in zip(got, want, strict=True):
        total += len(w)
        same += sum(1 for a, b in zip(g, w, strict=False) if a == b)
    return same / total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-agree", type=float, default=0.95)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = bench_model()
    adapters = make_adapters(model, args.adapters)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 8000) for _ in range(rng.randrange(8, 48))] for _ in range(args.prompts)]
    llamacpp.build(("llama-server",))
    print("llama-server ...", flush=True)
    served = _llama_server_greedy(model, adapters, prompts, args.tokens, args.threads)
    print("loraplex ...", flush=True)
    ours = _loraplex_greedy(model, adapters, prompts, args.tokens)
    rows = []
    base_want: list[list[int]] = []
    for index, name in [(None, "base")] + [(i, f"a{i}") for i in range(args.adapters)]:
        print(f"peft {name} ...", flush=True)
        want = _peft_greedy(model, None if index is None else adapters[index], prompts, args.tokens)
        base_want = base_want or want
        rows.append({"adapter": name, "llama_server_agree": _agreement(served[name], want),
                     "loraplex_agree": _agreement(ours[name], want),
                     # an adapter that changes nothing would make agreement trivial
                     "peft_differs_from_base": None if index is None else _agreement(want, base_want) < 1.0})
    print_table(f"greedy tokens agreeing with transformers + peft, position by position ({args.prompts} prompts "
                f"x {args.tokens} tokens, fp32, CPU)", rows,
                ["adapter", "llama_server_agree", "loraplex_agree", "peft_differs_from_base"])
    write_json("check_lora", {"rows": rows, "prompts": args.prompts, "tokens": args.tokens,
                              "llamacpp": llamacpp.version()})
    worst = min(min(r["llama_server_agree"], r["loraplex_agree"]) for r in rows)
    return 0 if worst >= args.min_agree else 1


if __name__ == "__main__":
    sys.exit(main())
