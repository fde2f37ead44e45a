"""Turn logits into tokens: penalties and logit bias, grammar masks, temperature, top-k/top-p/min-p, seeded sampling.

Rows are independent: every request draws its randomness from its own generator (seeded with its seed,
or, unseeded, with one derived from the engine's seed and the request id), so it produces the same tokens
alone or inside any batch, and a step that is re-run (engine.fault_isolation) draws the same noise again
once `restore` has put back the state `snapshot` took. Sampling uses the exponential race (argmax of p / E with
E ~ Exp(1)), which needs no sort and no cumulative sums over the vocabulary for plain temperature rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from engine.plan import SampledToken, SampleRow
from grammar import apply_bitmask


@dataclass(frozen=True)
class SamplerSnapshot:
    """The generator state of some requests before a step (see Sampler.snapshot)."""

    states: dict[str, torch.Tensor]  # request id -> its generator's state
    absent: frozenset[str]  # requests that had no generator yet


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, req_ids: set[str]) -> None:
        """Drop per-request generator state for finished requests."""
        for r in req_ids:
            self._generators.pop(r, None)

    def snapshot(self, req_ids: list[str]) -> SamplerSnapshot:
        """The generator state of `req_ids`, for `restore` after a step that failed. Mutates nothing."""
        states = {r: g.get_state() for r in req_ids if (g := self._generators.get(r)) is not None}
        return SamplerSnapshot(states, frozenset(r for r in req_ids if r not in states))

    def restore(self, snap: SamplerSnapshot) -> None:
        """Put back what `snapshot` saw: a re-run step draws exactly the noise the failed one drew."""
        for r, state in snap.states.items():
            g = self._generators.get(r)
            if g is not None:
                g.set_state(state)
        for r in snap.absent:
            self._generators.pop(r, None)

    def _generator(self, row: SampleRow) -> torch.Generator:
        g = self._generators.get(row.req_id)
        if g is None:
            seed = row.generator_seed if row.generator_seed is not None else self._derived_seed(row.req_id)
            g = self._generators[row.req_id] = torch.Generator(device=self.device).manual_seed(seed)
        return g

    def _derived_seed(self, req_id: str) -> int:
        """An unseeded request's seed: a function of the engine's seed and the request id (so not of the
        batch it runs in, nor of how often its step ran)."""
        digest = hashlib.blake2b(f"{self.seed}:{req_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow],
                 grammar: tuple[torch.Tensor, list[int]] | None = None) -> list[SampledToken | None]:
        """logits: (N, V) float32, one row per SampleRow.

        grammar: (bitmask, row indices) of the constrained rows; disallowed tokens are masked before any
        sampling mode (greedy included) picks. Logprobs stay those of the model's own distribution.
        A row whose logits are not all finite (NaN or inf: the model or the request's adapter
        overflowed) gets None instead of a token; every other row is sampled as usual.
        """
        raw_logits = logits
        raw_logprobs = None
        want_logprobs = [r.params.logprobs is not None for r in rows]
        if any(want_logprobs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)  # (N, V) of the model's own distribution
        logits = self._apply_penalties(logits, rows)
        if grammar is not None:
            if logits is raw_logits:
                logits = logits.clone()
            apply_bitmask(logits, *grammar)
        tokens = self._pick(logits, rows)  # (N,)
        # NOTE: the finiteness check rides on the one device->host copy of the tokens (no second sync). A
        # row's sum is NaN or inf when any of its logits is (one reduction: ~15x cheaper than isfinite().all()).
        tokens = torch.where(torch.isfinite(raw_logits.sum(dim=-1)), tokens, -1)
        token_list = tokens.tolist()
        out: list[SampledToken | None] = []
        for i, row in enumerate(rows):
            tok = token_list[i]
            if tok < 0:
                out.append(None)
                continue
            if raw_logprobs is None or row.params.logprobs is None:
                out.append(SampledToken(tok))
                continue
            lp = raw_logprobs[i]
            top = None
            if row.params.logprobs > 0:
                vals, idx = lp.topk(row.params.logprobs)
                top = list(zip(idx.tolist(), vals.tolist(), strict=True))
            out.append(SampledToken(tok, float(lp[tok]), top))
        return out

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        rows_to_fix = [i for i, r in enumerate(rows)
                       if r.params.needs_penalties or r.params.logit_bias or len(r.output_token_ids) < r.params.min_tokens]
        if not rows_to_fix:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i in rows_to_fix:
            row, p = rows[i], rows[i].params
            if p.logit_bias:  # NOTE: before the grammar mask: a bias never allows what the grammar forbids
                ids = [t for t, _ in p.logit_bias if t < vocab]
                biases = [b for t, b in p.logit_bias if t < vocab]
                logits[i, ids] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
            if len(row.output_token_ids) < p.min_tokens:
                stops = [t for t in (*row.eos_token_ids, *p.stop_token_ids) if t < vocab]
                logits[i, stops] = float("-inf")
            if not p.needs_penalties:
                continue
            out_ids = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros(vocab, device=logits.device).scatter_add_(
                0, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
            if p.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                seen[torch.tensor(row.prompt_token_ids, dtype=torch.long, device=logits.device)] = True
                seen |= counts > 0
                penalised = torch.where(logits[i] > 0, logits[i] / p.repetition_penalty,
                                        logits[i] * p.repetition_penalty)
                logits[i] = torch.where(seen, penalised, logits[i])
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    def _pick(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)  # greedy for every row; random rows are overwritten below
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random_rows:
            return tokens
        idx = torch.tensor(random_rows, device=logits.device)
        temps = torch.tensor([rows[i].params.temperature for i in random_rows], device=logits.device)
        scaled = logits[idx] / temps[:, None]  # (R, V)
        scaled = _top_k_top_p_min_p(scaled, [rows[i].params for i in random_rows])
        probs = torch.softmax(scaled, dim=-1)
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            noise[j].exponential_(generator=self._generator(rows[i]))
        tokens[idx] = (probs / noise).argmax(dim=-1)
        return tokens


def _top_k_top_p_min_p(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, nucleus top-p and min-p sets. (R, V) -> (R, V)."""
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(min_p):
        probs = torch.softmax(logits, dim=-1)
        mp = torch.tensor(min_p, device=logits.device)[:, None]
        logits = logits.masked_fill(probs < mp * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if not any(top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device)[:, None]
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs  # probability mass of strictly better tokens
    drop |= cum_before >= torch.tensor(top_p, device=logits.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
