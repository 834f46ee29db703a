"""Sampler: logits of the rows to sample -> token ids (+ logprobs). Last stage only.

Randomness is per token, not per batch: a seeded request draws its k-th output
token from a generator seeded with hash(seed, k), so the same seed gives the
same tokens whatever the batch mix, chunking or preemption history. Unseeded
requests draw from the stage's generator.

Logprobs are taken from the raw (unscaled, unfiltered) distribution, as vLLM
does by default.
"""

from __future__ import annotations

import torch
import xxhash

from pipeserve.engine.plan import SampledToken, SamplingSpec


def _token_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    mixed = xxhash.xxh3_64_intdigest(f"{seed}:{index}".encode()) & 0x7FFF_FFFF_FFFF_FFFF
    return torch.Generator(device=device).manual_seed(mixed)


def _filter(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on [R, V] float32 logits -> probabilities."""
    dev = logits.device
    vocab = logits.shape[-1]
    temps = torch.tensor([s.temperature for s in specs], device=dev, dtype=torch.float32)
    logits = logits / temps[:, None]
    top_k = torch.tensor([s.top_k if s.top_k > 0 else vocab for s in specs], device=dev)
    top_p = torch.tensor([s.top_p for s in specs], device=dev, dtype=torch.float32)
    min_p = torch.tensor([s.min_p for s in specs], device=dev, dtype=torch.float32)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always).
    # top_p == 1 filters nothing: a float cumsum can reach 1.0 before the tail.
    cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= (cum_before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop |= sorted_probs < (min_p[:, None] * sorted_probs[:, :1])
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        specs: list[SamplingSpec],
        sample_indices: list[int],
    ) -> list[SampledToken]:
        """logits [R, V] float32, one row per request to sample."""
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(specs) if not (s.temperature == 0 or s.top_k == 1)]
        if random_rows:
            probs = _filter(logits[random_rows], [specs[i] for i in random_rows])
            for j, i in enumerate(random_rows):
                seed = specs[i].seed
                gen = (
                    self.generator if seed is None else _token_generator(seed, sample_indices[i], self.device)
                )
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        want_lp = [i for i, s in enumerate(specs) if s.logprobs is not None]
        token_list = tokens.tolist()
        lp_rows: dict[int, tuple[float, list[tuple[int, float]]]] = {}
        if want_lp:
            lps = logits[want_lp].log_softmax(dim=-1)
            chosen = lps.gather(1, tokens[want_lp][:, None])[:, 0].tolist()
            kmax = max(specs[i].logprobs or 0 for i in want_lp)
            top_v, top_i = lps.topk(kmax, dim=-1) if kmax else (None, None)
            for j, i in enumerate(want_lp):
                k = specs[i].logprobs or 0
                top = (
                    list(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist(), strict=True))
                    if k and top_i is not None and top_v is not None
                    else []
                )
                lp_rows[i] = (chosen[j], top)
        out = []
        for i, rid in enumerate(req_ids):
            if i in lp_rows:
                lp, top = lp_rows[i]
                out.append(SampledToken(rid, token_list[i], lp, top))
            else:
                out.append(SampledToken(rid, token_list[i]))
        return out
