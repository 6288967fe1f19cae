"""DeepSeek-V4's MTP layer (`mtp.0.*`, as released) as the `mtp` draft: its drafts are what the layer computes (its
block run through transformers' own DeepSeek-V4 layer on the whole sequence, the target's streams taken from
transformers' model; chained drafts included) across chunked prefill and verification steps; speculation with it is
lossless, prefix hits and preemption included."""

from __future__ import annotations

import pytest
import torch

from reasoning_engine import LLM, SamplingParams
from reasoning_engine.speculative.draft import Draft
from test_engine_verification import OracleTree

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
V4 = dict(dtype="float32", device="cpu", block_size=8)


@pytest.fixture(scope="module")
def v4_mtp(tiny_checkpoint):
    """The checkpoint, transformers' target model, and the MTP layer's block as a one-layer transformers model (its
    `hc_head`, `norm` and the target's LM head around it) with the layer's input norms and projections."""
    from transformers import AutoModelForCausalLM

    ckpt = tiny_checkpoint("deepseek_v4_mtp")
    folder = ckpt.path.parent / f"{ckpt.name}-mtp"
    block = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return ckpt, ckpt.reference(), block, torch.load(folder / "mtp.pt")


class OracleChain(OracleTree):
    """Proposes the known continuation as a chain (DeepSeek-V4 verifies chains only), so drafts are accepted."""

    def propose(self, request_id: str, token_ids, max_draft_tokens: int) -> Draft:
        prompt = self.prompts[request_id]
        done = len(token_ids) - len(prompt)
        return Draft.path(self.answers[prompt][done : done + min(3, max_draft_tokens)])


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@torch.no_grad()
def reference_chain(target, block, extra: dict, ids: list[int], k: int) -> tuple[list[int], list[float]]:
    """The MTP layer's greedy chain after `ids` on the whole sequence: position t pairs the target's last-layer
    streams at t with token t + 1; chained positions take the layer's own output streams and its argmax."""
    out: dict[str, torch.Tensor] = {}
    hook = target.model.layers[-1].register_forward_hook(lambda m, args, result: out.__setitem__("streams", result))
    target(torch.tensor([ids]))
    hook.remove()
    features, tokens = out["streams"][:, :-1], torch.tensor([ids[1:]])
    eps = target.config.rms_norm_eps
    layer = block.model.layers[0]
    drafts, probs = [], []
    for _ in range(k):
        e = _rms(target.model.embed_tokens(tokens), extra["enorm.weight"], eps) @ extra["e_proj.weight"].T
        x = e.unsqueeze(2) + _rms(features, extra["hnorm.weight"], eps) @ extra["h_proj.weight"].T
        pre = layer.register_forward_pre_hook(lambda m, args, kwargs: ((x, *args[1:]), kwargs), with_kwargs=True)
        post = layer.register_forward_hook(lambda m, args, result: out.__setitem__("mtp", result))
        p = block(tokens).logits[0, -1].softmax(-1)  # the layer's input replaced by x; positions 0 .. len - 1
        pre.remove()
        post.remove()
        token = int(p.argmax())
        drafts.append(token)
        probs.append(float(p[token]))
        features = torch.cat([features, out["mtp"][:, -1:]], dim=1)
        tokens = torch.cat([tokens, torch.tensor([[token]])], dim=1)
    return drafts, probs


def test_drafts_are_what_the_mtp_layer_computes(v4_mtp) -> None:
    """A prompt crossing the 8-token window and many compressed rows, prefilled 8 tokens a step, then verified
    drafts (an oracle's, so they are accepted and the layer's cache advances by several positions a step): every
    chained draft of the layer equals the reference, and so does its score."""
    ckpt, target, block, extra = v4_mtp
    prompt = torch.randint(2, ckpt.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    plain = LLM(str(ckpt.path), **V4).generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    plain = list(plain[0].outputs[0].token_ids)
    llm = LLM(str(ckpt.path), max_num_batched_tokens=8, adaptive=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 4}, **V4)
    engine = llm.engine
    engine.spec.proposer = OracleChain({tuple(prompt): plain})
    drafter = engine.runner.worker.drafters["mtp"]
    request_id = engine.add_request(None, {"prompt_token_ids": prompt}, GREEDY)
    request = engine.groups[request_id][0]
    checked = 0
    while not request.is_finished:
        engine.step()
        if request.is_finished or request.is_prefilling:
            continue
        tokens = request.all_token_ids
        (draft,) = drafter.propose_batch([(request.seq_id, tokens, 3)])
        expected, probs = reference_chain(target, block, extra, tokens, 3)
        assert draft.token_ids == expected, len(tokens)
        assert draft.score == pytest.approx(probs[0] + probs[0] * probs[1] + probs[0] * probs[1] * probs[2], rel=1e-4)
        checked += 1
    assert checked >= 5 and request.output_token_ids == plain
    assert engine.stats().spec_decode["accepted_tokens"] > 10


def test_speculation_with_the_mtp_layer_is_lossless(v4_mtp) -> None:
    """Mixed prompts, a repeated one (a prefix hit) and a cache small enough to preempt: the plain tokens, and no
    block or draft state left behind."""
    ckpt = v4_mtp[0]
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, ckpt.vocab_size, (n,), generator=gen).tolist() for n in (5, 30, 61)]
    prompts.append(prompts[2][:50] + [7, 8])
    plain_llm = LLM(str(ckpt.path), enable_prefix_caching=False, max_num_seqs=1, **V4)
    want = [list(o.outputs[0].token_ids) for o in plain_llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                                      use_tqdm=False)]
    llm = LLM(str(ckpt.path), kv_cache_blocks=24, max_model_len=96, max_num_batched_tokens=24, adaptive=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **V4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    engine = llm.engine
    assert engine.stats().spec_decode["draft_tokens"] > 0 and engine.num_preemptions > 0
    assert outs[3].num_cached_tokens > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.runner.worker.drafters["mtp"].states
