"""DeepSeek Sparse Attention kernels: the torch reference (`kernels/sparse_attention.py`) against dense MLA and a
per-query float64 reference, and the Triton kernels (`kernels/triton_sparse_attention.py`) against the reference,
over ragged steps mixing decode, prefill chunks over a cached context and draft trees."""

import dataclasses

import pytest
import torch
from kernel_asserts import assert_close
from test_engine_backends import greedy_by_backend
from test_triton_attention import make_batch

from reasoning_engine.kernels import (
    attention,
    sparse_attention,
    triton_attention,
    triton_sparse_attention,
)

BLOCK = 16
LATENT, ROPE, HEADS = 32, 16, 4
INDEX_HEADS, INDEX_DIM = 8, 32
# decode over short and long contexts, a prefill chunk over a cached context, a first chunk
SHAPES = [([37, 0, 70, 5], [1, 9, 1, 40]), ([12, 50], [3, 1])]


def _inputs(context_lens, query_lens, device, dtype=torch.float32, tree=False):
    batch, num_blocks = make_batch(context_lens, query_lens, BLOCK, device, tree=tree)
    tokens = batch.num_tokens
    kv_cache = torch.randn(num_blocks, BLOCK, LATENT + ROPE, device=device).to(dtype)
    k_cache = torch.randn(num_blocks, BLOCK, INDEX_DIM, device=device).to(dtype)
    q = torch.randn(tokens, HEADS, LATENT + ROPE, device=device).to(dtype)
    q_index = torch.randn(tokens, INDEX_HEADS, INDEX_DIM, device=device).to(dtype)
    weights = torch.randn(tokens, INDEX_HEADS, device=device)
    return batch, kv_cache, k_cache, q, q_index, weights


def _visible(batch) -> list[set[int]]:
    """Per query token, the context positions it may see (cached context, causal prefix or tree ancestors)."""
    qsl = batch.query_start_loc.tolist()
    out = []
    for b, seq_len in enumerate(batch.seq_lens_cpu):
        ctx = seq_len - (qsl[b + 1] - qsl[b])
        for i in range(qsl[b + 1] - qsl[b]):
            seen = set(range(ctx))
            for j in range(i + 1):
                if batch.tree_mask is None or bool(batch.tree_mask[qsl[b] + i, j]):
                    seen.add(ctx + j)
            out.append(seen)
    return out


def _chosen(selected: torch.Tensor) -> list[set[int]]:
    return [{p for p in row if p >= 0} for row in selected.tolist()]


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("context_lens, query_lens", SHAPES)
def test_topk_covering_the_context_selects_every_visible_token(context_lens, query_lens, tree, device) -> None:
    batch, _, k_cache, _, q_index, weights = _inputs(context_lens, query_lens, device, tree=tree)
    selected = sparse_attention.indexer_topk(q_index, weights, k_cache, batch, topk=4096)
    assert selected.shape == (batch.num_tokens, batch.max_seq_len)
    assert _chosen(selected) == _visible(batch)


@pytest.mark.parametrize("module", [sparse_attention, triton_sparse_attention])
def test_equal_scores_go_to_the_earliest_positions(module, device) -> None:
    """Zero index queries score every token 0: each query keeps its first 8 visible positions, whatever else the
    batch holds (torch's topk would leave the order of ties to the row length)."""
    batch, _, k_cache, _, q_index, weights = _inputs([37, 0, 70, 5], [1, 9, 1, 40], device)
    selected = module.indexer_topk(torch.zeros_like(q_index), weights, k_cache, batch, topk=8)
    assert [sorted(c) for c in _chosen(selected)] == [sorted(v)[:8] for v in _visible(batch)]


@pytest.mark.parametrize("context_lens, query_lens", SHAPES + [([0, 3, 90], [48, 1, 2])])
def test_full_selection_equals_dense_mla(context_lens, query_lens, device) -> None:
    """The last shape mixes a long chunk with short queries: the reference attends by parts there."""
    batch, kv_cache, k_cache, q, q_index, weights = _inputs(context_lens, query_lens, device)
    meta = attention.prepare_attention(batch, BLOCK)
    everything = sparse_attention.indexer_topk(q_index, weights, k_cache, batch, topk=4096)
    dense = attention.paged_latent_attention(q, kv_cache, LATENT, batch, meta, 0.3)
    sparse = sparse_attention.sparse_latent_attention(q, kv_cache, LATENT, batch, meta, 0.3, everything)
    torch.testing.assert_close(sparse, dense, rtol=1e-6, atol=1e-6)


def _naive_sparse(q, kv_cache, batch, selected, scale):
    """Per query in float64: softmax over its selected positions' latent rows."""
    out = torch.zeros(q.shape[0], q.shape[1], LATENT, dtype=torch.float64)
    seq_of = sparse_attention.token_sequences(batch, q.shape[0]).tolist()
    rows = kv_cache.flatten(0, 1).double().cpu()
    for t, chosen in enumerate(_chosen(selected.cpu())):
        pos = torch.tensor(sorted(chosen))
        slots = batch.block_tables[seq_of[t]].long().cpu()[pos // BLOCK] * BLOCK + pos % BLOCK
        kv = rows[slots]
        probs = (q[t].double().cpu() @ kv.T * scale).softmax(-1)
        out[t] = probs @ kv[:, :LATENT]
    return out


@pytest.mark.parametrize("context_lens, query_lens", SHAPES)
def test_sparse_attention_matches_per_query_reference(context_lens, query_lens, device) -> None:
    batch, kv_cache, k_cache, q, q_index, weights = _inputs(context_lens, query_lens, device)
    selected = sparse_attention.indexer_topk(q_index, weights, k_cache, batch, topk=8)
    assert all(len(c) == min(8, len(v)) for c, v in zip(_chosen(selected), _visible(batch)))
    meta = attention.prepare_attention(batch, BLOCK)
    got = sparse_attention.sparse_latent_attention(q, kv_cache, LATENT, batch, meta, 0.3, selected)
    torch.testing.assert_close(got.double().cpu(), _naive_sparse(q, kv_cache, batch, selected, 0.3),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("context_lens, query_lens", SHAPES)
def test_triton_indexer_matches_reference(context_lens, query_lens, tree, device) -> None:
    batch, _, k_cache, _, q_index, weights = _inputs(context_lens, query_lens, device, tree=tree)
    tokens = batch.num_tokens
    want = sparse_attention.indexer_scores(q_index, weights, k_cache, batch, 0, tokens)
    got = triton_sparse_attention.indexer_scores(q_index, weights, k_cache, batch, 0, tokens)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert_close(got[finite], want[finite], scale=10.0)
    picked = triton_sparse_attention.indexer_topk(q_index, weights, k_cache, batch, topk=8)
    assert _chosen(picked) == _chosen(sparse_attention.indexer_topk(q_index, weights, k_cache, batch, topk=8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context_lens, query_lens", SHAPES)
def test_triton_sparse_mla_matches_reference(context_lens, query_lens, dtype, device) -> None:
    batch, kv_cache, k_cache, q, q_index, weights = _inputs(context_lens, query_lens, device, dtype)
    selected = sparse_attention.indexer_topk(q_index, weights, k_cache, batch, topk=40)  # -1 padded for short ones
    want = sparse_attention.sparse_latent_attention(q, kv_cache, LATENT, batch, attention.prepare_attention(batch, BLOCK),
                                                    0.3, selected)
    got = triton_sparse_attention.sparse_latent_attention(q, kv_cache, LATENT, batch,
                                                          triton_attention.prepare_attention(batch, BLOCK), 0.3, selected)
    assert_close(got, want, scale=2.0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_triton_backend_matches_torch_greedy(name: str, tiny_checkpoint, device: str) -> None:
    """End to end with index_topk 8: prompts past it, so the prefill and every decode step attend sparsely through
    the Triton indexer and sparse MLA kernels (and GLM-5's shared layer reuses a selection)."""
    outs = greedy_by_backend(tiny_checkpoint(name).path, device, [[3, 17, 9, 42, 5, 8, 11, 60, 70, 12, 90, 4],
                                                                 [7, 1, 30]], 8)
    assert outs["triton"] == outs["torch"]


@pytest.mark.parametrize("module, attention_module", [(sparse_attention, attention),
                                                      (triton_sparse_attention, triton_attention)])
def test_decode_at_the_cuda_graph_bound_equals_eager(module, attention_module, device) -> None:
    """A CUDA-graph decode batch carries the bound max_model_len as its host lengths and block tables that wide
    (`static_shapes`): the selection and the output are the eager step's."""
    batch, kv_cache, k_cache, q, q_index, weights = _inputs([37, 5, 70], [1, 1, 1], device)
    bound = 128
    tables = torch.zeros(batch.num_seqs, bound // BLOCK, dtype=batch.block_tables.dtype, device=device)
    tables[:, : batch.block_tables.shape[1]] = batch.block_tables
    graph = dataclasses.replace(batch, block_tables=tables, max_seq_len=bound, seq_lens_cpu=[bound] * batch.num_seqs,
                                static_shapes=True)
    outs = []
    for step in (batch, graph):
        selected = module.indexer_topk(q_index, weights, k_cache, step, topk=8)
        meta = attention_module.prepare_attention(step, BLOCK)
        outs.append((_chosen(selected), module.sparse_latent_attention(q, kv_cache, LATENT, step, meta, 0.3, selected)))
    assert outs[0][0] == outs[1][0]
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-6, atol=1e-6)
