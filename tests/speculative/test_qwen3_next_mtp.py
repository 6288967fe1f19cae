"""Qwen3-Next's and Qwen3.5's multi-token-prediction layer (`mtp.*` tensors) as the `mtp` draft of a hybrid model: its
logits are those of a plain torch reference of the layer, speculation with it is lossless for greedy and seeded
sampling (the accepted drafts' linear-attention states included), and without `method: mtp` its tensors are ignored.

The reference follows the published layout as vLLM reads it (vllm/model_executor/models/qwen3_next_mtp.py and
qwen3_5_mtp.py, `Qwen3NextMultiTokenPredictor.forward`): z = fc([pre_fc_norm_embedding(embed(x_{t+1}));
pre_fc_norm_hidden(h_t)]), one full-attention decoder layer of the model's kind, then `norm` and the target's LM head;
every norm is Gemma-style zero-centred (x * (1 + w), `GemmaRMSNorm as Qwen3NextRMSNorm`). The decoder layer's math
(a query projection holding each head's query and output gate, zero-centred q/k norms, rotary on the first
`partial_rotary_factor` of each head, softmax top-k MoE with a sigmoid-gated shared expert) is transformers'
Qwen3-Next decoder layer, whose target the engine matches in tests/models/test_parity.py. transformers 5 does not
implement the MTP layer itself."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from reasoning_engine import LLM, SamplingParams
from test_engine_verification import OracleTree

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prompts(seed: int, lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 256, (n,), generator=gen).tolist() for n in lengths]


def _tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def _text_config(path: Path) -> dict:
    config = json.loads((path / "config.json").read_text())
    return config.get("text_config", config)


# ---- the torch reference of the MTP layer ----

def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight)


def _rotate(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Rotary embedding (halves rotated) on the first `rotary_dim` channels of each head; x is [T, heads, d]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    angles = positions[:, None].float() * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + rotated * sin, rest], -1)


def _swiglu(x: torch.Tensor, w: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    gate, up = x @ w[f"{prefix}gate_proj.weight"].T, x @ w[f"{prefix}up_proj.weight"].T
    return (F.silu(gate) * up) @ w[f"{prefix}down_proj.weight"].T


def _mlp(x: torch.Tensor, w: dict[str, torch.Tensor], c: dict) -> torch.Tensor:
    p = "mtp.layers.0.mlp."
    if not c.get("num_experts"):
        return _swiglu(x, w, p)
    probs = (x @ w[f"{p}gate.weight"].T).softmax(-1)
    top, experts = probs.topk(c["num_experts_per_tok"], dim=-1)
    top = top / top.sum(-1, keepdim=True) if c.get("norm_topk_prob", True) else top
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(top[t], experts[t].tolist()):
            out[t] += weight * _swiglu(x[t : t + 1], w, f"{p}experts.{e}.")[0]
    shared = torch.sigmoid(x @ w[f"{p}shared_expert_gate.weight"].T) * _swiglu(x, w, f"{p}shared_expert.")
    return out + shared


def _decoder_layer(z: torch.Tensor, w: dict[str, torch.Tensor], c: dict) -> torch.Tensor:
    """The MTP's gated full-attention layer over positions 0..T-1 (causal), then its MLP; pre-norm residuals."""
    p, eps = "mtp.layers.0.", c["rms_norm_eps"]
    heads, kv_heads, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    t = z.shape[0]
    x = _norm(z, w[f"{p}input_layernorm.weight"], eps)
    q, gate = (x @ w[f"{p}self_attn.q_proj.weight"].T).view(t, heads, 2 * d).split([d, d], dim=-1)
    k = (x @ w[f"{p}self_attn.k_proj.weight"].T).view(t, kv_heads, d)
    v = (x @ w[f"{p}self_attn.v_proj.weight"].T).view(t, kv_heads, d)
    q, k = _norm(q, w[f"{p}self_attn.q_norm.weight"], eps), _norm(k, w[f"{p}self_attn.k_norm.weight"], eps)
    rope = c.get("rope_parameters") or {}
    rotary_dim = int(d * rope.get("partial_rotary_factor", 0.25))
    positions = torch.arange(t)
    q, k = _rotate(q, positions, rotary_dim, rope["rope_theta"]), _rotate(k, positions, rotary_dim, rope["rope_theta"])
    k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    attn = attn.transpose(0, 1) * torch.sigmoid(gate)
    z = z + attn.reshape(t, heads * d) @ w[f"{p}self_attn.o_proj.weight"].T
    return z + _mlp(_norm(z, w[f"{p}post_attention_layernorm.weight"], eps), w, c)


class Reference:
    """The target's final-normed hidden states from transformers, the MTP layer in plain torch from the tensors."""

    def __init__(self, checkpoint) -> None:
        self.model = checkpoint.reference()
        self.config = _text_config(checkpoint.path)
        self.w = {k: v.float() for k, v in load_file(checkpoint.path / "model.safetensors").items()}
        text = getattr(self.model.model, "language_model", self.model.model)
        self.text = text

    @torch.no_grad()
    def mtp_logits(self, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [T, V] of the MTP layer for positions t = 0..T-1 pairing hidden[t] with tokens[t] (token t + 1),
        and its normed outputs (what a chained position reads in place of the target's hidden state)."""
        w, eps = self.w, self.config["rms_norm_eps"]
        embedded = _norm(self.text.embed_tokens(tokens), w["mtp.pre_fc_norm_embedding.weight"], eps)
        z = torch.cat([embedded, _norm(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ w["mtp.fc.weight"].T
        z = _norm(_decoder_layer(z, w, self.config), w["mtp.norm.weight"], eps)
        return self.model.lm_head(z), z

    @torch.no_grad()
    def chain(self, ids: list[int], k: int) -> torch.Tensor:
        """The MTP layer's greedy chain after `ids` (the last is the root), on the whole sequence; the logits [k, V]
        of each drafted position."""
        hidden = self.text(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
        tokens = torch.tensor(ids[1:])
        rows = []
        for _ in range(k):
            logits, z = self.mtp_logits(hidden, tokens)
            rows.append(logits[-1])
            hidden, tokens = torch.cat([hidden, z[-1:]]), torch.cat([tokens, logits[-1].argmax().view(1)])
        return torch.stack(rows)


@pytest.mark.parametrize("name", ["qwen3_next_mtp", "qwen3_5_mtp"])  # MoE and dense, plain and wrapped layouts
def test_draft_logits_equal_the_torch_reference(tiny_checkpoint, name: str) -> None:
    """Across chunked prefill and verification steps that accept tree nodes out of order, each chained draft's logits
    (first from the pass over the step's kept positions, then the chained passes) equal the reference's on the whole
    sequence, and the draft's score is its expected accepted length."""
    checkpoint = tiny_checkpoint(name)
    reference = Reference(checkpoint)
    prompt = _prompts(1, (21,))[0]
    plain = _tokens(LLM(checkpoint.path, dtype="float32", device="cpu").generate([{"prompt_token_ids": prompt}], GREEDY))[0]
    llm = LLM(checkpoint.path, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=8, adaptive=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 6})
    engine = llm.engine
    engine.spec.proposer = OracleTree({tuple(prompt): plain})
    drafter = engine.runner.worker.drafters["mtp"]
    model = drafter.model
    logits_seen: list[torch.Tensor] = []
    greedy = model.greedy

    def recording(head_input: torch.Tensor):
        logits_seen.append(model.tables.logits(head_input).float())
        return greedy(head_input)

    model.greedy = recording
    request_id = engine.add_request(None, {"prompt_token_ids": prompt}, GREEDY)
    request = engine.groups[request_id][0]
    checked = 0
    while not request.is_finished:
        engine.step()
        if request.is_finished or request.is_prefilling:
            continue
        first = logits_seen[-1][0]  # the step's pass over its kept positions: the root's draft
        logits_seen.clear()
        (draft,) = drafter.propose_batch([(request.seq_id, request.all_token_ids, 3)])
        logits = torch.stack([first, *(row[0] for row in logits_seen)])
        expected = reference.chain(request.all_token_ids, 3)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        assert draft.token_ids == expected.argmax(-1).tolist()
        probs = expected.softmax(-1).max(-1).values.tolist()
        assert draft.score == pytest.approx(probs[0] + probs[0] * probs[1] + probs[0] * probs[1] * probs[2], rel=1e-4)
        checked += 1
    assert checked >= 5 and request.output_token_ids == plain
    assert engine.stats().spec_decode["accepted_tokens"] > 10


def _exact_mtp_checkpoint(source: Path, target: Path) -> Path:
    """A copy of `source` in which every block adds nothing to the residual stream (zero o_proj, out_proj and
    down_proj), so the target's next token is a function of the current token only: argmax lm_head(norm(embed(x))).
    The MTP layer keeps just the normed embedding of the token after the hidden state (fc = [I | 0], a zero-centred
    norm weight of 0 is the plain RMSNorm) and ends in the model's final norm, so it predicts the target's token at
    t + 2 (RMSNorm of an RMS-normed vector is itself, up to eps)."""
    shutil.copytree(source, target)
    hidden = _text_config(source)["hidden_size"]
    tensors = load_file(source / "model.safetensors")
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            tensor.zero_()
    tensors["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden)
    final_norm = next(k for k in ("model.norm.weight", "model.language_model.norm.weight") if k in tensors)
    tensors["mtp.norm.weight"] = tensors[final_norm].clone()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.fixture(scope="module")
def exact_mtp(tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _exact_mtp_checkpoint(tiny_checkpoint("qwen3_next_mtp").path, tmp_path_factory.mktemp("q") / "exact_mtp")


def _assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    states = engine.scheduler.states
    assert len(states.free) + states.num_snapshots == states.num_slots and not states.pending
    assert not engine.runner.worker.drafters["mtp"].states


@pytest.mark.parametrize("exact", [False, True], ids=["random_mtp", "exact_mtp"])
def test_outputs_with_mtp_drafts_equal_plain_decoding(tiny_checkpoint, exact_mtp: Path, exact: bool) -> None:
    """Greedy and seeded sampling (n > 1, prompts across block boundaries, prefilled in chunks) give the tokens of the
    run without drafts; drafts are verified, and an MTP layer that predicts the target has them all accepted."""
    path = exact_mtp if exact else tiny_checkpoint("qwen3_next_mtp").path
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, (5, 19, 37))]
    seeded = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    plain_llm = LLM(path, dtype="float32", device="cpu", block_size=4)
    plain_greedy = _tokens(plain_llm.generate(prompts, GREEDY))
    plain_seeded = [[list(c.token_ids) for c in o.outputs] for o in plain_llm.generate(prompts, seeded)]
    llm = LLM(path, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16, adaptive=False,
              speculative_config=MTP)
    assert _tokens(llm.generate(prompts, GREEDY)) == plain_greedy
    stats = llm.engine.stats().spec_decode
    assert stats["draft_tokens"] > 0
    if exact:  # drafts are shorter only where max_tokens leaves less room
        assert stats["accepted_tokens"] == stats["draft_tokens"] > len(prompts) * GREEDY.max_tokens // 2, stats
    assert [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, seeded)] == plain_seeded
    if exact:
        assert llm.engine.stats().spec_decode["accepted_tokens"] > stats["accepted_tokens"]
    _assert_no_leak(llm)


def test_random_stress_with_aborts_preemption_and_prefix_hits(exact_mtp: Path) -> None:
    """Random lengths, arrivals between steps, aborts, repeated prompts (prefix hits restore state snapshots while the
    draft cache reuses the hit blocks' entries) and a cache small enough to preempt, with accepted MTP drafts: every
    finished request has the tokens of the plain run and nothing leaks."""
    rng = random.Random(0)
    params_of = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 30), ignore_eos=True) for _ in range(14)]
    pool = _prompts(5, (17, 33, 50))
    prompts = [pool[i % 3] if i % 2 else _prompts(100 + i, (rng.randint(3, 60),))[0] for i in range(14)]
    plain_llm = LLM(exact_mtp, dtype="float32", device="cpu", enable_prefix_caching=False, max_num_seqs=1)
    wanted = {f"r{i}": _tokens(plain_llm.generate([{"prompt_token_ids": p}], params_of[i]))[0]
              for i, p in enumerate(prompts)}
    llm = LLM(exact_mtp, dtype="float32", device="cpu", block_size=8, kv_cache_blocks=24, max_model_len=160,
              max_num_batched_tokens=32, speculative_config=MTP, adaptive=False)
    engine = llm.engine
    aborted: set[str] = set()
    done: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)

    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params_of[i])
        for _ in range(rng.randint(0, 3)):
            step()
        if rng.random() < 0.2:
            engine.abort_request(f"r{i}")
            aborted.add(f"r{i}")
    while engine.has_unfinished_requests():
        step()
    assert {rid: done[rid] for rid in wanted if rid not in aborted} == {rid: t for rid, t in wanted.items()
                                                                          if rid not in aborted}
    stats = engine.stats().spec_decode
    assert stats["accepted_tokens"] > 0 and engine.block_manager.prefix_hits > 0 and engine.num_preemptions > 0
    _assert_no_leak(llm)


@pytest.mark.parametrize("name", ["qwen3_next_mtp", "qwen3_5_mtp"])
def test_without_method_mtp_the_mtp_tensors_are_ignored(tiny_checkpoint, name: str) -> None:
    """The checkpoint with the MTP layer runs exactly as the one without it (same weights otherwise)."""
    without = {"qwen3_next_mtp": "qwen3_next", "qwen3_5_mtp": "qwen3_5"}[name]
    prompts = [{"prompt_token_ids": p} for p in _prompts(4, (6, 17))]
    outs = [_tokens(LLM(tiny_checkpoint(n).path, dtype="float32", device="cpu").generate(prompts, GREEDY))
            for n in (name, without)]
    assert outs[0] == outs[1]


def test_a_checkpoint_without_the_mtp_layer_is_rejected(tiny_checkpoint) -> None:
    for name in ("qwen3_next", "qwen3_5"):
        with pytest.raises(ValueError, match=r"speculative_config.method 'mtp'.*'mtp\.'"):
            LLM(tiny_checkpoint(name).path, dtype="float32", device="cpu", speculative_config=MTP)
