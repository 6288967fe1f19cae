"""Batched sampling: every row of the logits is one sampling decision with its own settings.

Order of operations (as vLLM applies them): penalties, logit bias, min_tokens and bad-word masking, the allowed-token
mask (structured output's grammar, allowed_token_ids), then greedy argmax or temperature, top-k, top-p, min-p and a
draw. Logprobs are reported from the model's raw distribution. A draw uses the
exponential-race form of Gumbel-max (argmax p_i / E_i with E_i ~ Exp(1)). A seeded request's noise for the token at
output position t is a pure function of (its stream seed, t): kernels/sampling.py's counter-based stream, so its
token there depends only on that and the distribution it sees, not on the batch, on earlier steps, or on whether the
token comes from a plain step or from verifying a draft (speculative/verify.py draws it the same way).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from reasoning_engine.kernels.sampling import exponential_noise, stream_key
from reasoning_engine.outputs import Logprob


def stream_seed(seed: int, sample: int) -> int:
    """The 64-bit seed of the random stream of sample `sample` (n > 1) of a request with `seed` (any integer): a
    BLAKE2b digest of both, so streams of different seeds and samples are unrelated (seed + sample would give seed
    6's stream to seed 5's second sample). As a signed int64, as torch holds it."""
    digest = hashlib.blake2b(f"{seed}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


@dataclass
class SamplingMetadata:
    """Per-row settings, built by the engine each step; tensors are [N] on the logits' device."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor  # 0 = off
    min_p: torch.Tensor
    greedy: list[bool]
    streams: list[tuple[int, int] | None]  # a seeded row's (stream seed, output position it draws); None: unseeded
    num_logprobs: list[int | None]
    all_greedy: bool
    needs_filters: bool
    # penalties (None when no row uses them)
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    prompt_ids: list[list[int]] | None = None
    output_ids: list[list[int]] | None = None
    banned: list[list[int]] | None = None  # tokens masked this step (EOS / stop ids before min_tokens)
    forced: list[int | None] | None = None  # token that must be emitted (end of thinking when the budget is spent)
    bias: torch.Tensor | None = None  # [N, vocab] added to the logits (logit_bias)
    allowed: torch.Tensor | None = None  # [N, vocab] bool: the only tokens a row may emit (grammar, allowed_token_ids)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]
    sampled_logprobs: list[float]


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    num_rows, vocab = logits.shape
    device = logits.device
    counts = torch.zeros(num_rows, vocab, device=device)
    seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
    for row in range(num_rows):
        out_ids = torch.tensor(meta.output_ids[row], dtype=torch.long, device=device)
        counts[row].index_add_(0, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
        seen[row, torch.tensor(meta.prompt_ids[row], dtype=torch.long, device=device)] = True
    seen |= counts > 0
    rep = meta.repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - meta.frequency.unsqueeze(1) * counts
    return logits - meta.presence.unsqueeze(1) * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, outside the top-p nucleus (Holtzman et al., 2019) or below min_p * p_max."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    drop |= (before >= top_p.unsqueeze(1)) & (top_p.unsqueeze(1) < 1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    drop[:, 0] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def top_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_logprobs: list[int | None]) -> list[dict[int, Logprob] | None]:
    """For rows that asked: the chosen token and the top-N alternatives, with 1-based ranks."""
    wanted = [i for i, n in enumerate(num_logprobs) if n is not None]
    if not wanted:
        return [None] * len(token_ids)
    result: list[dict[int, Logprob] | None] = [None] * len(token_ids)
    width = max(num_logprobs[i] for i in wanted)
    top_values, top_ids = logprobs[wanted].topk(max(width, 1), dim=-1)
    chosen = torch.tensor([token_ids[i] for i in wanted], device=logprobs.device)
    chosen_lp = logprobs[wanted].gather(1, chosen.unsqueeze(1)).squeeze(1)
    chosen_rank = (logprobs[wanted] > chosen_lp.unsqueeze(1)).sum(dim=-1) + 1
    for j, row in enumerate(wanted):
        entry = {token_ids[row]: Logprob(float(chosen_lp[j]), int(chosen_rank[j]))}
        for rank in range(num_logprobs[row]):
            tok = int(top_ids[j, rank])
            entry.setdefault(tok, Logprob(float(top_values[j, rank]), rank + 1))
        result[row] = entry
    return result


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @staticmethod
    def process(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Logits after penalties, logit bias and masking (min_tokens, bad words, then the allowed tokens of a
        grammar or allowed_token_ids): what greedy decoding takes the argmax of."""
        if meta.presence is not None:
            logits = apply_penalties(logits, meta)
        if meta.bias is not None:
            logits = logits + meta.bias.to(logits.dtype)
        if meta.banned is not None:
            logits = logits.clone()
            for row, banned in enumerate(meta.banned):
                if banned:
                    logits[row, banned] = float("-inf")
        if meta.allowed is not None:
            logits = logits.masked_fill(~meta.allowed, float("-inf"))
        return logits

    @staticmethod
    def probabilities(processed: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The distribution a row samples from: temperature, then top-k / top-p / min-p."""
        scaled = processed / meta.temperature.clamp_min(1e-5).unsqueeze(1)
        if meta.needs_filters:
            scaled = filter_logits(scaled, meta.top_k, meta.top_p, meta.min_p)
        return scaled.softmax(dim=-1)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw_logprobs = logits.log_softmax(dim=-1)
        token_ids = self.choose(self.process(logits, meta), meta)
        if meta.forced is not None:
            token_ids = [f if f is not None else t for t, f in zip(token_ids, meta.forced)]
        index = torch.tensor(token_ids, device=logits.device).unsqueeze(1)
        sampled = raw_logprobs.gather(1, index).squeeze(1).tolist()
        return SamplerOutput(token_ids, top_logprobs(raw_logprobs, token_ids, meta.num_logprobs), sampled)

    def choose(self, processed: torch.Tensor, meta: SamplingMetadata) -> list[int]:
        """Each row's token from its processed logits: the argmax for greedy rows, a draw for the others."""
        greedy_ids = processed.argmax(dim=-1)
        if meta.all_greedy:
            return greedy_ids.tolist()
        probs = self.probabilities(processed, meta)
        drawn = (probs / self._noise(probs, meta)).argmax(dim=-1)
        greedy = torch.tensor(meta.greedy, device=processed.device)
        return torch.where(greedy, greedy_ids, drawn).tolist()

    def _noise(self, probs: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Exp(1) noise per row and token: a seeded row's from its stream at its output position (on the logits'
        device; rows of one draft tree at the same depth share it), an unseeded row's from the sampler's generator
        (CPU) or the device's; greedy rows get none."""
        noise = torch.ones_like(probs)
        rows, vocab = range(probs.shape[0]), probs.shape[1]
        unseeded = [row for row in rows if not meta.greedy[row] and meta.streams[row] is None]
        if unseeded:
            drawn = torch.empty(len(unseeded), vocab, dtype=probs.dtype, device=probs.device)
            noise[unseeded] = (drawn.exponential_(generator=self.generator) if probs.device.type == "cpu"
                               else drawn.exponential_())
        seeded = [row for row in rows if not meta.greedy[row] and meta.streams[row] is not None]
        if seeded:
            streams = torch.tensor([meta.streams[row] for row in seeded], device=probs.device)
            unique, which = streams.unique(dim=0, return_inverse=True)
            noise[seeded] = exponential_noise(stream_key(*unique.unbind(1)), vocab).to(noise.dtype)[which]
        return noise
