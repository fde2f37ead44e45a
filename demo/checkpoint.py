"""Tiny random Llama-family checkpoints and trained tokenizers, made locally in seconds.

Nothing here reaches a model hub. `loraplex serve` with no `--model` builds its demo model with these
functions (in a child process, `python -m demo.checkpoint OUT_DIR`: they use torch and the gateway never
loads it), the tests build their fixtures with them, and the benchmarks build the SmolLM-shaped bench
model with them. The output is an ordinary HF-format directory (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json) that `transformers` loads too.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

TokenizerKind = Literal["byte_bpe", "sentencepiece"]

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
SPECIAL_TOKENS = [BOS, EOS, EOT, HEADER_START, HEADER_END, "<|pad|>"]

# A Llama-3-style template; rendered by tokenization.tokenizer in a sandboxed Jinja environment.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

_WORDS = ["the", "model", "serves", "many", "tenants", "with", "their", "own", "adapters", "and", "a", "shared", "base", "while", "the", "cache", "keeps", "prefixes", "of", "system", "prompts", "hot", "across", "requests", "so", "that", "each", "token", "costs", "less", "time", "memory", "and", "money", "json", "schema", "object", "array", "string", "number", "integer", "true", "false", "null", "name", "value", "key", "list", "of", "items", "with", "id", "email", "date", "price", "total", "count", "status", "ok", "error", "user", "assistant", "system", "hello", "world", "please", "answer", "question", "what", "why", "how", "when", "where", "which", "who", "can", "could", "would", "should", "will", "shall", "may", "might", "must"]
_UNICODE = ["héllo", "naïve", "café", "日本語", "中文字", "한국어", "😀", "🚀", "👩‍💻", "Ωmega", "→", "ß", "€", "🙂"]
_SYMBOLS = ['{"', '":', '",', "}", "[", "]", ", ", ": ", "0", "1", "2", "3", "42", "3.14", "-7", "\n", "\t"]


def synthetic_corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic mixed text to train on: English-like words, a Zipf-distributed lexicon of
    pseudo-words (enough distinct merges for an 8k vocabulary), JSON-ish symbols, CJK and emoji."""
    rng = random.Random(seed)
    onsets, vowels, codas = ["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "ch", "sh", "th", "st", "tr", "pl"], ["a", "e", "i", "o", "u", "ai", "ou", "ea"], [
        "", "", "n", "r", "s", "t", "l", "nd", "st"]
    lexicon = sorted({
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(rng.randint(1, 3)))
        for _ in range(6000)
    })
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    lines = []
    for _ in range(n_lines):
        parts = []
        for _ in range(rng.randint(4, 24)):
            r = rng.random()
            if r < 0.45:
                parts.append(rng.choice(_WORDS))
            elif r < 0.8:
                parts.append(rng.choices(lexicon, weights)[0])
            else:
                parts.append(rng.choice(_SYMBOLS if r < 0.92 else _UNICODE))
        lines.append(" ".join(parts))
    return lines


def train_tokenizer(out_dir: str | Path, kind: TokenizerKind = "byte_bpe", vocab_size: int = 1024) -> Path:
    """Train a small tokenizer and write tokenizer.json + tokenizer_config.json into out_dir.

    byte_bpe: GPT-2 / Llama 3 / Qwen style byte-level BPE (every byte is a base token).
    sentencepiece: Llama 2 / Mistral style BPE over "▁"-prefixed words with <0xNN> byte fallback.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = synthetic_corpus(n_lines=4000 if vocab_size <= 2048 else 20000)
    if kind == "byte_bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(corpus, trainer=trainer)
    elif kind == "sentencepiece":
        tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = None
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        specials = ["<unk>", *SPECIAL_TOKENS]
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - 256, special_tokens=specials, limit_alphabet=200, show_progress=False
        )
        tok.train_from_iterator(corpus, trainer=trainer)
        tok = _with_byte_tokens(tok, specials)
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}")
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": BOS,
        "eos_token": EOT,
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    if kind == "sentencepiece":
        config["unk_token"] = "<unk>"
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def _with_byte_tokens(tok, specials: list[str]):
    """Put <0x00>..<0xFF> into the BPE vocabulary as ordinary tokens right after the specials.

    Like Llama 2 / Mistral tokenizers: byte-fallback pieces are vocabulary entries, not special added
    tokens, so decoding with skip_special_tokens keeps the bytes they stand for.
    """
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    trained = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    order = specials + [f"<0x{b:02X}>" for b in range(256)] + [t for t, _ in trained if t not in specials]
    data["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    for added in data["added_tokens"]:
        added["id"] = data["model"]["vocab"][added["content"]]
    return Tokenizer.from_str(json.dumps(data))


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a random checkpoint. Defaults are a scaled-down Llama 3."""

    architecture: str = "LlamaForCausalLM"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    init_std: float = 0.08
    extra: dict = field(default_factory=dict)


# Scaled-down shapes of each supported family.
FAMILIES: dict[str, TinyModelSpec] = {
    "llama": TinyModelSpec(
        "LlamaForCausalLM",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        rope_theta=500000.0,
    ),
    "mistral": TinyModelSpec("MistralForCausalLM", extra={"sliding_window": None}),
    "qwen2": TinyModelSpec("Qwen2ForCausalLM", tie_word_embeddings=True, rope_theta=1000000.0),
    "qwen3": TinyModelSpec("Qwen3ForCausalLM", head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0),
}

# What `loraplex serve` runs with no --model: small but not trivial (4 layers, GQA 8/4 heads, hidden 256,
# llama3 rope; about 2.4 M parameters).
DEMO_SPEC = TinyModelSpec(**{**FAMILIES["llama"].__dict__, "hidden_size": 256, "intermediate_size": 704,
                             "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4})

# The bench model of the issues: SmolLM-135M's shape with an 8k vocabulary (about 111 M parameters).
SMOLLM_SHAPE = TinyModelSpec(
    "LlamaForCausalLM",
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    tie_word_embeddings=True,
    rope_theta=10000.0,
    init_std=0.02,
)


def _config_dict(spec: TinyModelSpec, vocab_size: int, bos_id: int, eos_ids: list[int]) -> dict:
    cfg: dict = {
        "architectures": [spec.architecture],
        "model_type": {
            "LlamaForCausalLM": "llama",
            "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2",
            "Qwen3ForCausalLM": "qwen3",
        }[spec.architecture],
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0],
        "torch_dtype": "float32",
    }
    if spec.head_dim is not None:
        cfg["head_dim"] = spec.head_dim
    if spec.architecture == "Qwen2ForCausalLM":
        cfg["use_sliding_window"] = False
    if spec.architecture == "Qwen3ForCausalLM":
        cfg["attention_bias"] = False
        cfg["use_sliding_window"] = False
    cfg.update(spec.extra)
    return cfg


def random_state_dict(spec: TinyModelSpec, vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random weights for `spec` (fp32)."""
    g = torch.Generator().manual_seed(seed)
    head_dim = spec.head_dim or spec.hidden_size // spec.num_attention_heads
    q_out, kv_out = spec.num_attention_heads * head_dim, spec.num_key_value_heads * head_dim
    h, inter = spec.hidden_size, spec.intermediate_size

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * spec.init_std

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    sd = {"model.embed_tokens.weight": rand(vocab_size, h), "model.norm.weight": norm(h)}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = rand(q_out, h)
        sd[p + "self_attn.k_proj.weight"] = rand(kv_out, h)
        sd[p + "self_attn.v_proj.weight"] = rand(kv_out, h)
        sd[p + "self_attn.o_proj.weight"] = rand(h, q_out)
        if spec.architecture == "Qwen2ForCausalLM":
            for name, n in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                sd[p + f"self_attn.{name}_proj.bias"] = rand(n)
        if spec.architecture == "Qwen3ForCausalLM":
            sd[p + "self_attn.q_norm.weight"] = norm(head_dim)
            sd[p + "self_attn.k_norm.weight"] = norm(head_dim)
        sd[p + "mlp.gate_proj.weight"] = rand(inter, h)
        sd[p + "mlp.up_proj.weight"] = rand(inter, h)
        sd[p + "mlp.down_proj.weight"] = rand(h, inter)
        sd[p + "input_layernorm.weight"] = norm(h)
        sd[p + "post_attention_layernorm.weight"] = norm(h)
    if not spec.tie_word_embeddings:
        sd["lm_head.weight"] = rand(vocab_size, h)
    return sd


def _token_id(tok, token: str) -> int:
    tid = tok.token_to_id(token)
    if tid is None:
        raise ValueError(f"the tokenizer has no {token!r} token")
    return tid


def make_checkpoint(
    out_dir: str | Path,
    spec: TinyModelSpec | str = "llama",
    *,
    tokenizer_kind: TokenizerKind = "byte_bpe",
    vocab_size: int = 1024,
    seed: int = 0,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write a complete random HF checkpoint (weights, config, tokenizer) into out_dir and return it.

    `tokenizer_dir` reuses an already trained tokenizer (its files are copied) to save time.
    `shards` > 1 writes model-0000i-of-0000n.safetensors plus model.safetensors.index.json.
    """
    from tokenizers import Tokenizer

    if isinstance(spec, str):
        spec = FAMILIES[spec]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json"):
            if (Path(tokenizer_dir) / name).is_file():
                (out / name).write_bytes((Path(tokenizer_dir) / name).read_bytes())
    else:
        train_tokenizer(out, tokenizer_kind, vocab_size)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    real_vocab = tok.get_vocab_size()
    # Round the embedding up like real checkpoints do (vocab padded to a multiple of 64).
    model_vocab = (real_vocab + 63) // 64 * 64
    bos_id, eos_id, eot_id = (_token_id(tok, t) for t in (BOS, EOS, EOT))
    # A chat style (demo/chat_styles.py) may end turns with its own token (<|im_end|>, </s>): it ends generation too.
    turn_end = json.loads((out / "tokenizer_config.json").read_text()).get("eos_token", EOT)
    eos_ids = list(dict.fromkeys([_token_id(tok, turn_end), eot_id, eos_id]))
    cfg = _config_dict(spec, model_vocab, bos_id, eos_ids)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"bos_token_id": bos_id, "eos_token_id": eos_ids, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))

    sd = {k: v.to(dtype).contiguous() for k, v in random_state_dict(spec, model_vocab, seed).items()}
    if shards <= 1:
        save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    names = sorted(sd)
    weight_map = {}
    per = (len(names) + shards - 1) // shards
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: sd[n] for n in names[i * per : (i + 1) * per]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m demo.checkpoint OUT_DIR`: write the demo model (DEMO_SPEC) into OUT_DIR."""
    parser = argparse.ArgumentParser(prog="python -m demo.checkpoint", description=main.__doc__)
    parser.add_argument("out_dir", help="directory to write the checkpoint into (created if missing)")
    args = parser.parse_args(argv)
    make_checkpoint(args.out_dir, DEMO_SPEC)
    return 0


if __name__ == "__main__":
    sys.exit(main())
