"""Sampler: logits of the rows to sample -> token ids (+ logprobs). Last stage only.

Randomness is per token, not per batch: a seeded request draws its k-th output
token from a generator seeded with hash(seed, k), so the same seed gives the
same tokens whatever the batch mix, chunking or preemption history. Unseeded
requests draw from the stage's generator.

Logprobs are taken from the raw (unscaled, unfiltered) distribution, as vLLM
does by default (`raw_logprobs`): before the logits processors too
(penalties, logit_bias, min_tokens — worker/penalties.py), which pick the
token of greedy and random rows alike.

No accepted parameter can produce NaN/inf probabilities:
* temperature < SAMPLING_EPS samples greedily (vLLM's rule); larger ones are
  clamped to MAX_TEMPERATURE, where the distribution is already uniform to
  float32 precision (so 1e300 does not become inf in float32);
* logits are float32 and non-finite values are replaced before scaling
  (NaN -> -inf never wins, +inf -> the largest float);
* every filter keeps the most probable token, so a row is never all -inf:
  top_p tiny keeps one token, min_p = 1 keeps the maxima, top_k beyond the
  vocabulary keeps everything.

Failure isolation (DESIGN §2.5): a request's failure is the request's. The
batch is sampled in one pass; if that raises, each row is sampled on its own
and only the rows that still raise fail, reported as `RequestFailure`s that
travel along the ring to stage 0, which finishes those requests with an error.
"""

from __future__ import annotations

import logging

import torch
import xxhash

from pipeserve.engine.plan import RequestFailure, SampledToken, SamplingSpec
from pipeserve.obs.ratelimit import RateLimitedLog
from pipeserve.sampling_params import SAMPLING_EPS
from pipeserve.worker.penalties import apply_processors

log = logging.getLogger(__name__)

MAX_TEMPERATURE = 1e4  # logits / 1e4 differ by < 1e-2 for any sane logit range: uniform already
# A row whose top-k / top-p / min-p keep only tokens among its CANDIDATES most probable samples
# from those (`_distributions`): a top-k of [R, V], not a sort.
CANDIDATES = 256


def _token_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    mixed = xxhash.xxh3_64_intdigest(f"{seed}:{index}".encode()) & 0x7FFF_FFFF_FFFF_FFFF
    return torch.Generator(device=device).manual_seed(mixed)


def is_greedy(spec: SamplingSpec) -> bool:
    return spec.temperature < SAMPLING_EPS or spec.top_k == 1


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits with NaN -> -inf and +inf -> the largest float32 (argmax stays meaningful)."""
    logits = logits.float()
    big = torch.finfo(torch.float32).max
    return torch.nan_to_num(logits, nan=float("-inf"), posinf=big, neginf=float("-inf"))


def _scaled(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """[R, V] logits / each row's temperature, after subtracting each row's max: the scaled
    logits are <= 0, so exp() cannot overflow."""
    temps = torch.tensor([_temperature(s) for s in specs], device=logits.device).float()
    return (logits - logits.max(dim=-1, keepdim=True).values) / temps[:, None]


def _limits(specs: list[SamplingSpec], vocab: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """Each row's (top_k, top_p, min_p) as [R] tensors; top_k outside (0, vocab) is the vocabulary."""
    top_k = torch.tensor([s.top_k if 0 < s.top_k < vocab else vocab for s in specs], device=dev)
    top_p = torch.tensor([s.top_p for s in specs], device=dev, dtype=torch.float32)
    min_p = torch.tensor([s.min_p for s in specs], device=dev, dtype=torch.float32)
    return top_k, top_p, min_p


def _drop(p: torch.Tensor, drop: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Add top-p's and min-p's drops to `drop` over probabilities `p` sorted descending: top-p keeps
    the smallest prefix whose mass reaches top_p (top_p == 1 filters nothing: a float cumsum can
    reach 1.0 before the tail); the first token is always kept."""
    drop = drop | ((p.cumsum(dim=-1) - p >= top_p[:, None]) & (top_p[:, None] < 1))
    drop |= p < (min_p[:, None] * p[:, :1])
    drop[:, 0] = False
    return drop


def _filter(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on [R, V] float32 logits -> probabilities (rows sum to 1)."""
    dev = logits.device
    vocab = logits.shape[-1]
    logits = _scaled(logits, specs)
    top_k, top_p, min_p = _limits(specs, vocab, dev)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.arange(vocab, device=dev)[None, :] >= top_k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    drop = _drop(sorted_probs, drop, top_p, min_p)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return filtered.softmax(dim=-1)


def _has_filter(spec: SamplingSpec, vocab: int) -> bool:
    return 0 < spec.top_k < vocab or spec.top_p < 1 or spec.min_p > 0


def _distributions(
    logits: torch.Tensor, specs: list[SamplingSpec]
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each row's sampling distribution, as `_filter` defines it, without its sort of the whole
    vocabulary where that is not needed: (probabilities, their token ids) over the row's
    CANDIDATES most probable tokens when its kept tokens provably lie among them (the last
    candidate is dropped by top-p or min-p, hence every token after it; or top_k <= CANDIDATES),
    (probabilities over the vocabulary, None) otherwise. A row with no filter is softmax(logits /
    T) as it stands; other rows fall back to `_filter` (a flat distribution: top-p keeps most of
    the vocabulary). Sorting [R, V] costs ~5 ms a row of a 49k vocabulary on a CPU: n=128 made
    sampling half of every step."""
    vocab = logits.shape[-1]
    out: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * len(specs)
    plain = [i for i, s in enumerate(specs) if not _has_filter(s, vocab)]
    if plain:
        probs = _scaled(logits[plain], [specs[i] for i in plain]).softmax(dim=-1)
        for j, i in enumerate(plain):
            out[i] = (probs[j], None)
    rest = [i for i, s in enumerate(specs) if _has_filter(s, vocab)]
    k = min(CANDIDATES, vocab)
    if rest and k < vocab:
        dev = logits.device
        sub = [specs[i] for i in rest]
        scaled = _scaled(logits[rest], sub)
        vals, ids = scaled.topk(k, dim=-1)  # sorted, descending
        top_k, top_p, min_p = _limits(sub, vocab, dev)
        within = top_k <= k  # top-k's renormalisation is over candidates only
        beyond = torch.arange(k, device=dev)[None, :] >= top_k[:, None]
        p_topk = vals.masked_fill(beyond, float("-inf")).softmax(dim=-1)
        p_all = (vals - scaled.logsumexp(dim=-1, keepdim=True)).exp()
        p = torch.where(within[:, None], p_topk, p_all)
        drop = _drop(p, beyond, top_p, min_p)
        # Exact: top-k within the candidates, or no top-k and the last candidate dropped (every
        # token after it has less mass before it and less probability: dropped too).
        exact = within | (drop[:, -1] & (top_k >= vocab))
        kept = vals.masked_fill(drop, float("-inf")).softmax(dim=-1)
        for j, i in enumerate(rest):
            if bool(exact[j]):
                out[i] = (kept[j], ids[j])
    slow = [i for i, o in enumerate(out) if o is None]
    if slow:
        probs = _filter(logits[slow], [specs[i] for i in slow])
        for j, i in enumerate(slow):
            out[i] = (probs[j], None)
    return [o for o in out if o is not None]


def _temperature(spec: SamplingSpec) -> float:
    return min(max(spec.temperature, SAMPLING_EPS), MAX_TEMPERATURE)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._fallbacks = RateLimitedLog(log, interval_s=60.0)  # a poison request fails each batch it is in

    def __call__(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        specs: list[SamplingSpec],
        sample_indices: list[int],
        histories: list[list[int] | None] | None = None,
    ) -> tuple[list[SampledToken], list[RequestFailure]]:
        """logits [R, V], one row per request to sample -> (tokens, failures); each row is in exactly one.
        histories: each row's token history (penalties.TokenHistories), None where not kept."""
        logits = _finite(logits)
        try:
            return self._sample(logits, req_ids, specs, sample_indices, histories), []
        except Exception:  # noqa: BLE001 - isolate the row(s) that raise, below (logged with exc_info)
            self._fallbacks.warning(
                "batched", "batched sampling failed; sampling %d rows one by one", len(req_ids), exc_info=True
            )
        tokens: list[SampledToken] = []
        failures: list[RequestFailure] = []
        for i, rid in enumerate(req_ids):
            try:
                hist = None if histories is None else [histories[i]]
                tokens += self._sample(logits[i : i + 1], [rid], [specs[i]], [sample_indices[i]], hist)
            except Exception as e:  # the request's failure, not the group's
                log.exception("request %s: sampling failed", rid)
                failures.append(RequestFailure(rid, f"sampling failed: {type(e).__name__}: {e}"))
        return tokens, failures

    def _sample(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        specs: list[SamplingSpec],
        sample_indices: list[int],
        histories: list[list[int] | None] | None = None,
    ) -> list[SampledToken]:
        # --- logits processors (penalties.py): `chosen_from` picks the token, `logits` (raw) gives
        # the logprobs. The same tensor when no row uses one. ---
        chosen_from = apply_processors(logits, specs, sample_indices, histories)
        if chosen_from is not logits:
            chosen_from = _finite(chosen_from)  # a logit / 0.01 may overflow
        # --- end of logits processors ---
        tokens = chosen_from.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(specs) if not is_greedy(s)]
        if random_rows:
            dists = _distributions(chosen_from[random_rows], [specs[i] for i in random_rows])
            for (probs, ids), i in zip(dists, random_rows, strict=True):
                seed = specs[i].seed
                gen = (
                    self.generator if seed is None else _token_generator(seed, sample_indices[i], self.device)
                )
                pick = torch.multinomial(probs, 1, generator=gen)[0]
                tokens[i] = pick if ids is None else ids[pick]
        want_lp = [i for i, s in enumerate(specs) if s.logprobs is not None]
        token_list = tokens.tolist()
        lp_rows: dict[int, tuple[float, list[tuple[int, float]]]] = {}
        if want_lp:
            lps = logits[want_lp].log_softmax(dim=-1)
            chosen = lps.gather(1, tokens[want_lp][:, None])[:, 0].tolist()
            kmax = min(max(specs[i].logprobs or 0 for i in want_lp), lps.shape[-1])
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
