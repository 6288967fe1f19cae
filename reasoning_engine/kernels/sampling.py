"""Token sampling in plain torch: temperature, top-k / top-p / min-p filtering, Gumbel-max sampling with counter-based
per-request randomness, and speculative rejection-sampling verification. The CPU path and the reference for
`triton_sampling`, which draws the same random numbers and so picks the same tokens.

Randomness: the noise for vocabulary entry j of the token a request generates with counter c (its output index) is a
pure function of (seed, c, j): a counter-based generator (Salmon et al., 2011, "Parallel Random Numbers: As Easy as
1, 2, 3") built from an integer finaliser (the `lowbias32` mixer, Wellons 2018). Results therefore do not depend on
which other requests share the batch or on the batch order, and no torch.Generator state is carried.

Sampling uses the Gumbel-max trick (Gumbel, 1954; Maddison et al., 2014): argmax_j(logit_j / T + G_j) with
G_j = -log(-log(U_j)) is a draw from softmax(logit / T); filtered entries get -inf.

Filters, per row (all in float32, on x = logits * (1 / temperature)):
- temperature < 1e-5 means greedy: argmax of the raw logits (first index on ties), no filtering, no noise.
- top_k > 0: keep x >= the k-th largest x (ties at the boundary are kept).
- top_p < 1: of what top-k kept, keep x >= t where t is the largest value whose kept entries at or above it carry
  at least top_p of the (renormalised) probability; the top entry always stays.
- min_p > 0: keep entries whose probability is at least min_p times the top entry's: exp(x - max x) >= min_p.
"""

from __future__ import annotations

import torch

GREEDY_TEMPERATURE = 1e-5
_MASK32 = 0xFFFFFFFF
_ACCEPT_INDEX = 0xFFFFFFFF  # noise index of the acceptance test in rejection sampling (never a vocabulary index)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on uint32 values held in int64 (products wrap; only the low 32 bits are kept)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def stream_key(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[...] int64 seeds and counters -> [...] int64 holding the uint32 key of that random stream."""
    seeds, counters = seeds.long(), counters.long()
    h = _mix32((seeds & _MASK32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seeds >> 32) & _MASK32))
    h = _mix32(h ^ (counters & _MASK32))
    return _mix32(h ^ ((counters >> 32) & _MASK32))


def uniform(keys: torch.Tensor, index: torch.Tensor | int) -> torch.Tensor:
    """Uniform float32 in (0, 1), 24 random bits, for stream `keys` at position `index` (broadcast)."""
    h = _mix32(((torch.as_tensor(index, device=keys.device).long() * 0x9E3779B9) + keys) & _MASK32)
    h = _mix32(h ^ keys)
    return ((h >> 8).float() + 0.5) * (2.0**-24)


def exponential_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys [...] -> Exp(1) noise [..., V] in float32: E = -log U. Its Gumbel form is G = -log E, so
    argmax_j p_j / E_j (the exponential race, layers/sampler.py) picks the token argmax_j log p_j + G_j does."""
    return -torch.log(uniform(keys.unsqueeze(-1), torch.arange(vocab_size, device=keys.device)))


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys [...] -> Gumbel(0, 1) noise [..., V] in float32."""
    return -torch.log(exponential_noise(keys, vocab_size))


def apply_sampling_filters(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """logits [B, V] -> float32 [B, V]: x = logits / T with filtered entries at -inf (softmax of it is the
    distribution `sample` draws from). Greedy rows come back as the raw logits."""
    greedy = temperature < GREEDY_TEMPERATURE
    inv_t = torch.where(greedy, torch.ones_like(temperature), 1.0 / temperature.float().clamp_min(GREEDY_TEMPERATURE))
    x = logits.float() * inv_t.float().unsqueeze(1)
    vocab = x.shape[1]
    if not x.numel():
        return x
    keep = torch.ones_like(x, dtype=torch.bool)
    k = top_k.long().clamp(0, vocab)
    use_k = (k > 0) & (k < vocab) & ~greedy
    ordered = x.sort(dim=1, descending=True).values
    kth = ordered.gather(1, (k - 1).clamp_min(0).unsqueeze(1))
    keep &= ~use_k.unsqueeze(1) | (x >= kth)
    top = ordered[:, :1]
    weights = torch.where(keep, torch.exp(x - top), torch.zeros_like(x))
    use_p = (top_p < 1) & ~greedy
    w_sorted = weights.sort(dim=1, descending=True)
    mass = w_sorted.values.cumsum(1)
    target = top_p.float().unsqueeze(1) * mass[:, -1:]
    cut = (mass < target).sum(1, keepdim=True).clamp_max(vocab - 1)  # first index whose running mass reaches top_p
    threshold = x.gather(1, w_sorted.indices.gather(1, cut))
    keep &= ~use_p.unsqueeze(1) | (x >= threshold)
    use_min_p = (min_p > 0) & ~greedy
    keep &= ~use_min_p.unsqueeze(1) | (torch.exp(x - top) >= min_p.float().unsqueeze(1))
    return torch.where(keep, x, torch.full_like(x, float("-inf")))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V]; temperature/top_p/min_p [B] float32; top_k [B] int (0 = off); seeds/counters [B] int64
    -> token ids [B] int64."""
    x = apply_sampling_filters(logits, temperature, top_k, top_p, min_p)
    greedy = temperature < GREEDY_TEMPERATURE
    noise = gumbel_noise(stream_key(seeds, counters), x.shape[1])
    return torch.where(greedy, x.argmax(1), (x + noise).argmax(1))


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling verification (Leviathan et al., 2023; Chen et al., 2023). Row b proposed
    num_draft_tokens[b] <= S tokens draft_token_ids[b, :n] drawn from draft_probs [B, S, V] (None: the drafter is
    deterministic, e.g. n-gram, i.e. one-hot draft probabilities); target_probs [B, S + 1, V] are the target model's
    (already filtered) probabilities at each draft position and one past the last. Draft i is accepted with
    probability min(1, p(x)/q(x)); at the first rejection a token is drawn from max(p - q, 0) (renormalised) and the
    row stops; if all n are accepted a bonus token is drawn from p at position n. Position i uses the random stream
    (seed, counters[b] + i). Returns (output ids [B, S + 1] int64 padded with -1, accepted drafts [B] int32); row b
    emits accepted + 1 tokens."""
    num_seqs, max_draft = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    positions = torch.arange(max_draft + 1, device=device)
    keys = stream_key(seeds.unsqueeze(1), counters.long().unsqueeze(1) + positions)
    n = num_draft_tokens.long().unsqueeze(1)
    drafts = draft_token_ids.long()
    p = target_probs.float()
    if draft_probs is None:
        q = torch.zeros(num_seqs, max_draft, vocab, device=device).scatter_(2, drafts.clamp(0, vocab - 1).unsqueeze(2), 1.0)
    else:
        q = draft_probs.float()
    q = torch.cat([q, torch.zeros(num_seqs, 1, vocab, device=device)], dim=1)
    q = torch.where((positions.unsqueeze(0) < n).unsqueeze(2), q, torch.zeros_like(q))  # bonus position: q = 0
    safe = drafts.clamp(0, vocab - 1).unsqueeze(2)
    p_x = p[:, :max_draft].gather(2, safe).squeeze(2)
    q_x = q[:, :max_draft].gather(2, safe).squeeze(2)
    accepted = uniform(keys[:, :max_draft], _ACCEPT_INDEX) * q_x < p_x
    accepted &= positions[:max_draft].unsqueeze(0) < n
    noise = gumbel_noise(keys, vocab)
    residual = (p - q).clamp_min(0)
    from_residual = torch.where(residual > 0, residual.log() + noise, torch.full_like(noise, float("-inf"))).argmax(2)
    from_target = torch.where(p > 0, p.log() + noise, torch.full_like(noise, float("-inf"))).argmax(2)
    recovered = torch.where(residual.amax(2) > 0, from_residual, from_target)
    rejected = torch.cat([~accepted, torch.ones(num_seqs, 1, dtype=torch.bool, device=device)], dim=1)
    first = rejected.long().argmax(1, keepdim=True).clamp_max(n)  # first rejection, or n when all were accepted
    out = torch.where(positions.unsqueeze(0) < first, torch.cat([drafts, drafts.new_full((num_seqs, 1), -1)], dim=1), torch.full_like(keys, -1))
    out = out.scatter(1, first, recovered.gather(1, first))
    return out, first.squeeze(1).to(torch.int32)
