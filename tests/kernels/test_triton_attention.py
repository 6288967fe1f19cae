"""Triton paged attention against the torch reference (`kernels/attention.py`) and a dense per-sequence reference."""

import dataclasses
import math

import pytest
import torch
from kernel_asserts import assert_close

from reasoning_engine.batch import ForwardBatch
from reasoning_engine.kernels import attention, triton_attention


def make_batch(context_lens, query_lens, block_size, device, tree=False, num_blocks=None):
    """A ragged step over randomly placed cache blocks; sequence b has context_lens[b] cached tokens and
    query_lens[b] new ones. With `tree`, each step gets a random draft tree (every token's parent precedes it)."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    need = [math.ceil(s / block_size) for s in seq_lens]
    total = sum(need)
    num_blocks = num_blocks or total + 3
    perm = torch.randperm(num_blocks)[:total].tolist()
    max_blocks = max(need, default=1) or 1
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots, positions = [], []
    cursor = 0
    for b, (ctx, q) in enumerate(zip(context_lens, query_lens)):
        blocks = perm[cursor : cursor + need[b]]
        cursor += need[b]
        tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(ctx, ctx + q):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
            positions.append(pos)
    tokens = len(slots)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()) if query_lens else [0], dtype=torch.int64)
    max_q = max(query_lens, default=0)
    tree_mask = None
    if tree:
        tree_mask = torch.zeros(tokens, max_q, dtype=torch.bool)
        for b, q in enumerate(query_lens):
            parent = [-1] + [int(torch.randint(-1, i, ()).item()) for i in range(1, q)]
            for i in range(q):
                node = i
                while node >= 0:
                    tree_mask[qsl[b] + i, node] = True
                    node = parent[node]
    batch = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        logits_indices=(qsl[1:] - 1).to(device),
        max_query_len=max_q,
        max_seq_len=max(seq_lens, default=0),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=seq_lens,
        tree_mask=None if tree_mask is None else tree_mask.to(device),
    )
    return batch, num_blocks


def dense_reference(q, cache_rows, batch, block_size, scale, v_dim, sinks=None, window=None):
    """Per-sequence float64 attention over the gathered cache: q [T, H, Dk]; cache_rows(slots) -> (k [L, KVH, Dk],
    v [L, KVH, Dv]). Visibility: all cached context, and the step's tokens by causal order (and the tree mask); with
    a `window`, only keys above the query's position - window; `sinks` [H] join each softmax's denominator."""
    out = torch.zeros(q.shape[0], q.shape[1], v_dim, dtype=torch.float64)
    qsl = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.seq_lens_cpu):
        q_len = qsl[b + 1] - qsl[b]
        ctx = seq_len - q_len
        pos = torch.arange(seq_len)
        slots = batch.block_tables[b].long().cpu()[pos // block_size] * block_size + pos % block_size
        k, v = cache_rows(slots)
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        for i in range(q_len):
            t = qsl[b] + i
            visible = pos <= ctx + i
            if batch.tree_mask is not None:
                step = torch.zeros(seq_len, dtype=torch.bool)
                step[ctx:] = batch.tree_mask[t, :q_len].cpu()
                visible &= (pos < ctx) | step
            if window is not None:
                visible &= pos > int(batch.positions[t]) - window
            s = torch.einsum("hd,lhd->hl", q[t].double().cpu(), k) * scale
            s[:, ~visible] = float("-inf")
            if sinks is not None:
                s = torch.cat([s, sinks.double().cpu().view(-1, 1)], dim=1)
            out[t] = torch.einsum("hl,lhd->hd", s.softmax(-1)[:, :seq_len], v)
    return out


def gqa_case(context_lens, query_lens, block_size, heads, kv_heads, head_dim, dtype, device, tree=False):
    batch, num_blocks = make_batch(context_lens, query_lens, block_size, device, tree=tree)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=device).to(dtype)
    tokens = batch.num_tokens
    triton_attention.write_kv_cache(k_cache, torch.randn(tokens, kv_heads, head_dim, device=device).to(dtype), batch.slot_mapping)
    triton_attention.write_kv_cache(v_cache, torch.randn(tokens, kv_heads, head_dim, device=device).to(dtype), batch.slot_mapping)
    q = torch.randn(tokens, heads, head_dim, device=device).to(dtype)
    return batch, q, k_cache, v_cache


DECODE_CASES = [
    ([0], [1]),  # a single token: the whole context is the query itself
    ([4, 0, 37], [1, 1, 1]),
    ([150, 2], [1, 1]),  # long enough for several non-empty splits, short enough for empty ones
]
PREFILL_CASES = [
    ([0], [1]),
    ([0, 5, 0], [7, 3, 1]),  # fresh prefill, chunked-prefill continuation, single token
    ([33, 0], [20, 70]),  # more queries than one tile of the kernel
]


DTYPE_BLOCKS = [(torch.float32, 1), (torch.float32, 3), (torch.float32, 16), (torch.bfloat16, 1), (torch.bfloat16, 16), (torch.float16, 5)]


@pytest.mark.parametrize("dtype,block_size", DTYPE_BLOCKS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 24)])
@pytest.mark.parametrize("lens", DECODE_CASES + PREFILL_CASES)
def test_paged_attention(device, dtype, block_size, heads, kv_heads, head_dim, lens):
    batch, q, k_cache, v_cache = gqa_case(*lens, block_size, heads, kv_heads, head_dim, dtype, device)
    scale = head_dim**-0.5
    meta = triton_attention.prepare_attention(batch, block_size, split_tokens=16)
    out = triton_attention.paged_attention(q, k_cache, v_cache, batch, meta, scale)
    ref = attention.paged_attention(q, k_cache, v_cache, batch, attention.prepare_attention(batch, block_size), scale)
    assert_close(out, ref, scale=2.0)


def test_paged_attention_matches_dense_float64(device):
    """The reference itself, against an independent per-sequence computation, with a draft tree."""
    batch, q, k_cache, v_cache = gqa_case([6, 0], [5, 4], 4, 4, 2, 8, torch.float32, device, tree=True)
    meta = triton_attention.prepare_attention(batch, 4)
    out = triton_attention.paged_attention(q, k_cache, v_cache, batch, meta, 0.3)
    rows = lambda slots: (k_cache.view(-1, 2, 8)[slots.to(device)].cpu(), v_cache.view(-1, 2, 8)[slots.to(device)].cpu())
    dense = dense_reference(q, rows, batch, 4, 0.3, 8)
    ref = attention.paged_attention(q, k_cache, v_cache, batch, attention.prepare_attention(batch, 4), 0.3)
    assert_close(out.cpu(), dense.float())
    assert_close(ref.cpu(), dense.float())


@pytest.mark.parametrize("lens", DECODE_CASES)
def test_decode_metadata_matches_the_ragged_case(device, lens):
    """A decode step's metadata (one query per sequence, built with half the ops) is what the general builder gives
    for the same batch, and the reference attention through it matches the dense computation."""
    batch, q, k_cache, v_cache = gqa_case(*lens, 3, 4, 2, 8, torch.float32, device)
    fast, ragged = attention._prepare_decode(batch, 3), attention._prepare_ragged(batch, 3)
    assert torch.equal(fast.kv_index, ragged.kv_index)
    assert torch.equal(fast.mask, ragged.mask)
    assert torch.equal(fast.query_rows, ragged.query_rows)
    assert (fast.padded, fast.needs_mask) == (ragged.padded, ragged.needs_mask)
    rows = lambda slots: (k_cache.view(-1, 2, 8)[slots.to(device)].cpu(), v_cache.view(-1, 2, 8)[slots.to(device)].cpu())
    ref = attention.paged_attention(q, k_cache, v_cache, batch, attention.prepare_attention(batch, 3), 0.3)
    assert_close(ref.cpu(), dense_reference(q, rows, batch, 3, 0.3, 8).float())


def test_uneven_decode_contexts_are_attended_by_length_and_match_dense(device):
    """One long context among short ones: the torch path attends the decodes in groups by power of two of their
    length (not every one padded to the longest), and the result is the dense computation's and the unsplit one's."""
    batch, q, k_cache, v_cache = gqa_case([600, 3, 7, 20, 0, 5], [1] * 6, 4, 4, 2, 8, torch.float32, device)
    meta = attention.prepare_attention(batch, 4)
    assert isinstance(meta, attention.MixedAttentionMetadata)
    groups = sorted(sorted(part.seq_lens_cpu) for _, part, _ in meta.parts)
    assert groups == [[1], [4], [6, 8], [21], [601]]  # lengths in (2^(k-1), 2^k] together
    out = attention.paged_attention(q, k_cache, v_cache, batch, meta, 0.3)
    whole = attention.paged_attention(q, k_cache, v_cache, batch, attention._prepare_decode(batch, 4), 0.3)
    rows = lambda slots: (k_cache.view(-1, 2, 8)[slots.to(device)].cpu(), v_cache.view(-1, 2, 8)[slots.to(device)].cpu())
    assert_close(out.cpu(), dense_reference(q, rows, batch, 4, 0.3, 8).float())
    assert_close(out, whole)
    even, *_ = gqa_case([30, 20, 40], [1] * 3, 4, 4, 2, 8, torch.float32, device)
    assert isinstance(attention.prepare_attention(even, 4), attention.TorchAttentionMetadata)


def test_a_mixed_step_whose_decodes_are_uneven_splits_them_again_and_matches_dense(device):
    """A verification step with a long chunk whose decoding sequences also differ widely in length: the decode part
    is itself attended by length, and the whole still matches the dense computation."""
    lens = ([7, 12, 0, 30, 3, 9, 20], [1, 4, 1, 40, 1, 3, 1])
    batch, q, k_cache, v_cache = gqa_case(*lens, 4, 4, 2, 8, torch.float32, device, tree=True)
    meta = attention.prepare_attention(batch, 4)
    decode_part = next(m for _, part, m in meta.parts if set(part.query_lens_cpu) == {1})
    assert isinstance(decode_part, attention.MixedAttentionMetadata)
    out = attention.paged_attention(q, k_cache, v_cache, batch, meta, 0.3)
    rows = lambda slots: (k_cache.view(-1, 2, 8)[slots.to(device)].cpu(), v_cache.view(-1, 2, 8)[slots.to(device)].cpu())
    assert_close(out.cpu(), dense_reference(q, rows, batch, 4, 0.3, 8).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("lens", [([0], [5]), ([9, 0, 3], [4, 1, 6])])
def test_tree_masked_attention(device, dtype, block_size, lens):
    batch, q, k_cache, v_cache = gqa_case(*lens, block_size, 4, 2, 16, dtype, device, tree=True)
    meta = triton_attention.prepare_attention(batch, block_size)
    out = triton_attention.paged_attention(q, k_cache, v_cache, batch, meta, 0.25)
    ref = attention.paged_attention(q, k_cache, v_cache, batch, attention.prepare_attention(batch, block_size), 0.25)
    assert_close(out, ref, scale=2.0)


def test_decode_slice_length_does_not_change_result(device):
    batch, q, k_cache, v_cache = gqa_case([200, 9], [1, 1], 16, 4, 2, 16, torch.float32, device)
    outs = [
        triton_attention.paged_attention(q, k_cache, v_cache, batch, triton_attention.prepare_attention(batch, 16, split_tokens=n), 0.25)
        for n in (256, 16, 7)
    ]
    assert_close(outs[1], outs[0])
    assert_close(outs[2], outs[0])


def test_split_plan_depends_on_the_sequence_alone():
    """Slices of split_tokens up to _MAX_SPLITS of them, then whole multiples of split_tokens; a launch sized for any
    longer bound has at least as many slices."""
    cap = triton_attention._MAX_SPLITS
    assert triton_attention.split_plan(1, 16) == (16, 1)
    assert triton_attention.split_plan(16 * cap, 16) == (16, cap)
    assert triton_attention.split_plan(16 * cap + 1, 16) == (32, cap // 2 + 1)
    assert triton_attention.split_plan(131072) == (1024, 128)
    for length in (1, 37, 256, 4097, 32768, 100_000):
        per_split, splits = triton_attention.split_plan(length)
        assert per_split % triton_attention._SPLIT_TOKENS == 0 and (splits - 1) * per_split < length <= splits * per_split
        assert splits <= min(triton_attention.launch_splits(bound) for bound in (length, length + 1, 32769, 131072, 10**6))


def _static(batch, bound, num_blocks, device):
    """`batch` as the CUDA-graph runner builds it: host lengths at the bound, block tables that wide (stale ids past
    each sequence's blocks), static_shapes."""
    wide = torch.randint(0, num_blocks, (batch.num_seqs, -(-bound // 16)), dtype=torch.int32, device=device)
    wide[:, : batch.block_tables.shape[1]] = batch.block_tables
    return dataclasses.replace(batch, block_tables=wide, max_seq_len=bound, seq_lens_cpu=[bound] * batch.num_seqs,
                               static_shapes=True)


def _rows(batch, rows):
    """The decode batch of only the sequences `rows` (same caches and block tables)."""
    index = torch.tensor(rows, device=batch.seq_lens.device)
    seq_lens = batch.seq_lens[index]
    return dataclasses.replace(
        batch, input_ids=batch.input_ids[index], positions=batch.positions[index], slot_mapping=batch.slot_mapping[index],
        query_start_loc=torch.arange(len(rows) + 1, device=index.device), seq_lens=seq_lens,
        block_tables=batch.block_tables[index], logits_indices=torch.arange(len(rows), device=index.device),
        max_seq_len=int(seq_lens.max()), query_lens_cpu=[1] * len(rows), seq_lens_cpu=seq_lens.tolist(),
    )


def _decode(kind, q, caches, batch):
    meta = triton_attention.prepare_attention(batch, 16, split_tokens=16, decode_kernel_heads=0 if kind == "mla_latent" else 16)
    if kind == "gqa":
        return triton_attention.paged_attention(q, *caches, batch, meta, 0.25)
    return triton_attention.paged_latent_attention(q, caches[0], 32, batch, meta, 0.2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gqa", "mla", "mla_latent"])
def test_decode_is_bitwise_batch_and_graph_invariant(device, kind):
    """A sequence's bf16 decode output is the same bits alone, in a batch with shorter and much longer sequences
    (which change the launch's slice count), and with the CUDA-graph path's static arguments (a bound of 4096). MLA
    at 4 heads takes the decode kernel; "mla_latent" sends it through the latent split kernel."""
    # 2100 > 16 x _MAX_SPLITS: its decode slices are 32 tokens (the latent kernel, whose cap is the SM count, needs no
    # such length: a shorter long sequence keeps its interpreted run short)
    lens = [37, 150, 5, 300] if kind == "mla_latent" else [37, 300, 5, 2100]
    if kind == "gqa":
        batch, q, *caches = gqa_case(lens, [1] * 4, 16, 4, 2, 16, torch.bfloat16, device)
    else:
        batch, q, *caches = mla_case(lens, [1] * 4, 16, 4, 32, 16, torch.bfloat16, device)
    mixed = _decode(kind, q, caches, batch)
    assert torch.equal(_decode(kind, q, caches, _static(batch, 4096, caches[0].shape[0], device)), mixed)
    for rows in ([0], [3], [2, 0]):
        index = torch.tensor(rows, device=q.device)
        assert torch.equal(_decode(kind, q[index], caches, _rows(batch, rows)), mixed[index]), rows


@pytest.mark.parametrize("lens", [[37], [150, 2, 9]])
def test_static_shape_decode_matches_exact_lengths(device, lens):
    """A CUDA-graph decode batch (`static_shapes`): host lengths are the bound max_model_len and the block tables are
    that wide, with stale ids past each sequence's blocks. Triton (launching slices for the bound that return at
    once) and the torch reference (masking a single sequence too) must give what the batch with exact lengths gives."""
    batch, q, k_cache, v_cache = gqa_case(lens, [1] * len(lens), 16, 4, 2, 16, torch.float32, device)
    bound = 4096
    wide = torch.randint(0, k_cache.shape[0], (batch.num_seqs, bound // 16), dtype=torch.int32, device=device)
    wide[:, : batch.block_tables.shape[1]] = batch.block_tables
    static = dataclasses.replace(batch, block_tables=wide, max_seq_len=bound, seq_lens_cpu=[bound] * batch.num_seqs,
                                 static_shapes=True)
    for module in (triton_attention, attention):
        exact = module.paged_attention(q, k_cache, v_cache, batch, module.prepare_attention(batch, 16), 0.25)
        out = module.paged_attention(q, k_cache, v_cache, static, module.prepare_attention(static, 16), 0.25)
        if module is triton_attention:  # each sequence's slices do not depend on the bound: the same bits
            assert torch.equal(out, exact)
        else:
            assert_close(out, exact)


def test_empty_batch(device):
    batch, q, k_cache, v_cache = gqa_case([], [], 16, 4, 2, 16, torch.float32, device)
    meta = triton_attention.prepare_attention(batch, 16)
    assert triton_attention.paged_attention(q, k_cache, v_cache, batch, meta, 1.0).shape == (0, 4, 16)


def mla_case(context_lens, query_lens, block_size, heads, latent, rope, dtype, device, tree=False):
    batch, num_blocks = make_batch(context_lens, query_lens, block_size, device, tree=tree)
    kv_cache = torch.randn(num_blocks, block_size, latent + rope, device=device).to(dtype)
    triton_attention.write_kv_cache(kv_cache, torch.randn(batch.num_tokens, latent + rope, device=device).to(dtype), batch.slot_mapping)
    q = torch.randn(batch.num_tokens, heads, latent + rope, device=device).to(dtype)
    return batch, q, kv_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("heads,latent,rope", [(4, 32, 16), (3, 40, 8)])
@pytest.mark.parametrize("lens", DECODE_CASES + PREFILL_CASES[1:])
def test_paged_latent_attention(device, dtype, block_size, heads, latent, rope, lens):
    batch, q, kv_cache = mla_case(*lens, block_size, heads, latent, rope, dtype, device)
    scale = (latent + rope) ** -0.5
    meta = triton_attention.prepare_attention(batch, block_size, split_tokens=16)
    out = triton_attention.paged_latent_attention(q, kv_cache, latent, batch, meta, scale)
    ref = attention.paged_latent_attention(q, kv_cache, latent, batch, attention.prepare_attention(batch, block_size), scale)
    assert_close(out, ref, scale=2.0)


def test_latent_attention_matches_dense_float64_with_tree(device):
    batch, q, kv_cache = mla_case([5, 0], [4, 3], 2, 3, 24, 8, torch.float32, device, tree=True)
    meta = triton_attention.prepare_attention(batch, 2)
    out = triton_attention.paged_latent_attention(q, kv_cache, 24, batch, meta, 0.2)

    def rows(slots):
        kv = kv_cache.view(-1, 32)[slots.to(device)].cpu().unsqueeze(1)
        return kv, kv[..., :24]

    assert_close(out.cpu(), dense_reference(q, rows, batch, 2, 0.2, 24).float())


@pytest.mark.parametrize("window", [None, 6])
def test_verification_step_attends_its_decodes_apart_from_its_drafts(device, window):
    """A step where a few sequences verify draft trees among many that decode (and one long chunk): the decodes are
    attended as a decode step (not padded to the drafts' length), the drafts under their trees, the chunk alone;
    the torch reference through those parts matches the dense computation, GQA with sinks and a window and MLA."""
    lens = ([7, 12, 0, 30, 3, 9, 6], [1, 4, 1, 40, 1, 3, 1])  # decode contexts even: one decode part
    batch, q, k_cache, v_cache = gqa_case(*lens, 4, 4, 2, 8, torch.float32, device, tree=True)
    meta = attention.prepare_attention(batch, 4)
    assert isinstance(meta, attention.MixedAttentionMetadata)
    parts = {tuple(part.query_lens_cpu): part_meta for _, part, part_meta in meta.parts}
    assert set(parts) == {(40,), (1, 1, 1, 1), (4, 3)}
    assert parts[(1, 1, 1, 1)].mask.shape[1] == 1 and not parts[(1, 1, 1, 1)].padded  # one query row per sequence
    sinks = torch.randn(4, device=device)
    out = attention.paged_attention(q, k_cache, v_cache, batch, meta, 0.3, sinks, window)
    rows = lambda slots: (k_cache.view(-1, 2, 8)[slots.to(device)].cpu(), v_cache.view(-1, 2, 8)[slots.to(device)].cpu())
    assert_close(out.cpu(), dense_reference(q, rows, batch, 4, 0.3, 8, sinks, window).float())

    batch, q, kv_cache = mla_case(*lens, 4, 3, 24, 8, torch.float32, device, tree=True)
    out = attention.paged_latent_attention(q, kv_cache, 24, batch, attention.prepare_attention(batch, 4), 0.2)

    def latent_rows(slots):
        kv = kv_cache.view(-1, 32)[slots.to(device)].cpu().unsqueeze(1)
        return kv, kv[..., :24]

    assert_close(out.cpu(), dense_reference(q, latent_rows, batch, 4, 0.2, 24).float())


# decode steps as compile_decode's graphs see them: one sequence (no mask), several with lengths spread across blocks
FUSED_DECODE_CASES = [([37], [1]), ([4, 0, 37], [1, 1, 1]), ([150, 2, 9, 31, 64], [1] * 5)]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("lens", FUSED_DECODE_CASES)
def test_fused_decode_attention_matches_the_gather_path(device, lens, compiled):
    """With `fused_decode` set, as compile_decode does, `paged_attention` and `paged_latent_attention` compute
    through `decode_attention`, eagerly and compiled, and give the gather path's result on the same step."""
    run = torch.compile(lambda f, *args: f(*args), fullgraph=True) if compiled else (lambda f, *args: f(*args))
    batch, q, k_cache, v_cache = gqa_case(*lens, 3, 6, 2, 16, torch.float32, device)
    ref = attention.paged_attention(q, k_cache, v_cache, batch, attention.prepare_attention(batch, 3), 0.3)
    meta = dataclasses.replace(attention.prepare_attention(batch, 3), fused_decode=True)
    assert_close(run(attention.paged_attention, q, k_cache, v_cache, batch, meta, 0.3), ref)

    batch, q, kv_cache = mla_case(*lens, 3, 4, 24, 8, torch.float32, device)
    ref = attention.paged_latent_attention(q, kv_cache, 24, batch, attention.prepare_attention(batch, 3), 0.2)
    meta = dataclasses.replace(attention.prepare_attention(batch, 3), fused_decode=True)
    assert_close(run(attention.paged_latent_attention, q, kv_cache, 24, batch, meta, 0.2), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 2, 3), (4, 7), (1, 1, 1)])
def test_write_kv_cache(device, dtype, shape):
    block_size = shape[0]
    cache = torch.randn(6, *shape, device=device).to(dtype)
    ref_cache = cache.clone()
    slots = torch.randperm(6 * block_size, device=device)[:5]
    values = torch.randn(5, *shape[1:], device=device)
    triton_attention.write_kv_cache(cache, values, slots)
    attention.write_kv_cache(ref_cache, values, slots)
    if dtype == torch.bfloat16:  # the interpreter truncates float32 -> bfloat16 where torch rounds
        assert_close(cache, ref_cache)
    else:
        assert torch.equal(cache, ref_cache)


def test_write_kv_cache_strided_values_and_empty(device):
    cache = torch.zeros(2, 4, 2, 3, device=device)
    kv = torch.randn(3, 2, 6, device=device)
    triton_attention.write_kv_cache(cache, kv[..., 3:], torch.tensor([7, 0, 2], device=device))
    assert torch.equal(cache.view(-1, 2, 3)[torch.tensor([7, 0, 2], device=device)], kv[..., 3:])
    triton_attention.write_kv_cache(cache, kv[:0, :, 3:], torch.zeros(0, dtype=torch.int64, device=device))


class _LaunchRecorder:
    """Stands in for a Triton kernel: records each launch's grid, then launches the kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


@pytest.fixture
def latent_launches(monkeypatch):
    """The grids of the latent split kernel, its merge, the decode and the prefill kernel launched while the test
    runs."""
    recorders = {}
    for name in ("_latent_partial_kernel", "_latent_reduce_kernel", "_decode_partial_kernel", "_prefill_kernel"):
        recorders[name] = _LaunchRecorder(getattr(triton_attention, name))
        monkeypatch.setattr(triton_attention, name, recorders[name])
    return {name: r.grids for name, r in recorders.items()}


def _latent_rows(kv_cache, latent, device):
    def rows(slots):
        kv = kv_cache.view(-1, kv_cache.shape[-1])[slots.to(device)].cpu().unsqueeze(1)
        return kv, kv[..., :latent]
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_decode_groups_all_heads_of_a_sequence_in_one_program(device, latent_launches, dtype):
    """MLA decode at 64 heads (Kimi K2.5 without TP): one program per (sequence, context slice) holds every head as
    the rows of its tile, so each latent tile is read once for all heads; the slices merged give the torch
    reference's and the dense computation's result."""
    heads = 64
    lens = ([150, 3], [1, 1])
    batch, q, kv_cache = mla_case(*lens, 16, heads, 32, 16, dtype, device)
    meta = triton_attention.prepare_attention(batch, 16, split_tokens=16)
    out = triton_attention.paged_latent_attention(q, kv_cache, 32, batch, meta, 0.2)
    ref = attention.paged_latent_attention(q, kv_cache, 32, batch, attention.prepare_attention(batch, 16), 0.2)
    assert_close(out, ref, scale=2.0)
    if dtype == torch.float32:
        assert_close(out.cpu(), dense_reference(q, _latent_rows(kv_cache, 32, device), batch, 16, 0.2, 32).float())
    assert latent_launches["_latent_partial_kernel"] == [(2, 1, 10)]  # 151 keys in slices of 16; all heads at once
    assert latent_launches["_prefill_kernel"] == [] and latent_launches["_decode_partial_kernel"] == []


@pytest.mark.parametrize("heads", [16, 24])
def test_decodes_alone_with_few_heads_take_the_decode_kernel(device, latent_launches, heads):
    """A step of MLA decodes alone with at most 16 heads (Kimi K2.5 under TP 8: 8) goes through the decode kernel,
    one program holding every head over a cache tile; more heads, or a step that also verifies a draft, through the
    latent split kernel (at 24 heads, 3 draft tokens' rows span two row blocks). Both give the torch reference's
    result."""
    assert [triton_attention.decodes_take_decode_kernel(h) for h in (1, 8, 16, 17, 64)] == [True, True, True, False, False]
    few = heads <= 16
    for query_lens in ([1, 1, 1], [1, 3, 1]):
        batch, q, kv_cache = mla_case([40, 7, 20], query_lens, 4, heads, 24, 8, torch.float32, device, tree=True)
        meta = triton_attention.prepare_attention(batch, 4)  # default slices: one each here
        out = triton_attention.paged_latent_attention(q, kv_cache, 24, batch, meta, 0.2)
        ref = attention.paged_latent_attention(q, kv_cache, 24, batch, attention.prepare_attention(batch, 4), 0.2)
        assert_close(out, ref)
        decode_kernel = few and max(query_lens) == 1
        assert len(latent_launches["_decode_partial_kernel"]) == decode_kernel
        row_blocks = -(-max(query_lens) * 32 // 64) if heads == 24 else 1
        assert latent_launches["_latent_partial_kernel"] == ([] if decode_kernel else [(3, row_blocks, 1)])
        for grids in latent_launches.values():
            grids.clear()


def test_one_slice_step_copies_its_partial_outputs_instead_of_merging(device, latent_launches):
    """When every sequence of a step without long chunks fits one slice, merging is a cast: the partial outputs are
    copied into the output (no merge launch), with the bits the merge gives: the same step with the CUDA-graph
    path's bound (many slices launched, one used by each sequence) goes through the merge and gives the same output.
    float32: the interpreter narrows float32 to bf16 by truncation where a GPU (and torch's copy) round to nearest
    even, so only a GPU run compares the bf16 bits."""
    batch, q, kv_cache = mla_case([40, 7, 0], [1, 4, 3], 4, 8, 24, 8, torch.float32, device, tree=True)
    out = triton_attention.paged_latent_attention(q, kv_cache, 24, batch,
                                                  triton_attention.prepare_attention(batch, 4, split_tokens=64), 0.2)
    assert latent_launches["_latent_partial_kernel"] == [(3, 1, 1)] and latent_launches["_latent_reduce_kernel"] == []
    static = _static(batch, 1024, kv_cache.shape[0], device)
    merged = triton_attention.paged_latent_attention(q, kv_cache, 24, static,
                                                     triton_attention.prepare_attention(static, 4, split_tokens=64), 0.2)
    assert latent_launches["_latent_partial_kernel"][1] == (3, 1, 16) and len(latent_launches["_latent_reduce_kernel"]) == 1
    assert torch.equal(out, merged)
    assert_close(out.cpu(), dense_reference(q, _latent_rows(kv_cache, 24, device), batch, 4, 0.2, 24).float())


def test_latent_split_plan_fills_the_gpu_from_the_sequence_alone():
    """Kimi K2.5's latent rows (512 + 64 bf16): slices of whole 64-key tiles, at least as many keys as the partial
    output weighs (two tiles at 64 heads, one at 8), as many slices as SMs for long contexts; batch 1 at 1k context
    runs 8 or 16 programs, not 4. A launch sized for any longer bound has at least the slices a sequence uses."""
    wide, narrow = (triton_attention.latent_min_split(h, 512, 1152) for h in (64, 8))
    assert (wide, narrow) == (128, 64)
    assert triton_attention.latent_split_plan(1024, wide, 132) == (128, 8)
    assert triton_attention.latent_split_plan(1024, narrow, 132) == (64, 16)
    assert triton_attention.latent_split_plan(32768, wide, 132) == (256, 128)
    assert triton_attention.latent_split_plan(131072, narrow, 132) == (1024, 128)
    for length in (1, 37, 1024, 4097, 32768, 100_000, 131072):
        per_split, splits = triton_attention.latent_split_plan(length, wide, 132)
        assert per_split % wide == 0 and (splits - 1) * per_split < length <= splits * per_split and splits <= 132
        assert splits <= min(triton_attention.latent_launch_splits(b, wide, 132) for b in (length, length + 1, 131072))


def test_mixed_step_sends_decodes_and_drafts_to_the_latent_kernel_and_long_chunks_to_prefill(device, latent_launches):
    """One step with decodes, draft trees, a short chunk and a long chunk: the sequences of at most `short_query`
    query tokens go through the latent split kernel (query tokens x heads as its rows, under the draft tree), the long
    chunk alone through the prefill kernel; the whole matches the dense computation and the torch reference."""
    lens = ([40, 7, 0, 30, 3, 9, 20], [1, 4, 1, 12, 1, 3, 1])  # short_query 6: the 12-token chunk is long
    batch, q, kv_cache = mla_case(*lens, 4, 8, 24, 8, torch.float32, device, tree=True)
    meta = triton_attention.prepare_attention(batch, 4, split_tokens=8, short_query=6)
    assert (meta.short_rows, meta.short_max_query_len, meta.has_long) == (11, 4, True)
    out = triton_attention.paged_latent_attention(q, kv_cache, 24, batch, meta, 0.2)
    assert_close(out.cpu(), dense_reference(q, _latent_rows(kv_cache, 24, device), batch, 4, 0.2, 24).float())
    ref = attention.paged_latent_attention(q, kv_cache, 24, batch, attention.prepare_attention(batch, 4), 0.2)
    assert_close(out, ref)
    # 4 draft tokens x 8 heads: one row block (rows past 64 are test_decodes_alone_...'s 24-head case); 41 keys in
    # slices of 16
    assert latent_launches["_latent_partial_kernel"] == [(7, 1, 3)]
    assert len(latent_launches["_prefill_kernel"]) == 1


def test_a_verification_step_alone_goes_through_the_latent_kernel(device, latent_launches):
    """Drafts and decodes without a long chunk: no prefill launch at all."""
    batch, q, kv_cache = mla_case([33, 5, 0], [5, 1, 3], 4, 8, 24, 8, torch.bfloat16, device, tree=True)
    meta = triton_attention.prepare_attention(batch, 4, split_tokens=8)
    out = triton_attention.paged_latent_attention(q, kv_cache, 24, batch, meta, 0.2)
    ref = attention.paged_latent_attention(q, kv_cache, 24, batch, attention.prepare_attention(batch, 4), 0.2)
    assert_close(out, ref, scale=2.0)
    assert latent_launches["_prefill_kernel"] == [] and len(latent_launches["_latent_partial_kernel"]) == 1


def test_wide_latent_reads_each_tile_in_one_program_for_every_value_channel(device, latent_launches):
    """A 256-channel latent (Kimi's is 512): one program per (row block, slice) holds every value channel, so each
    latent tile is loaded once for the QK product and the values of every head; decodes and draft trees together
    still match the dense computation."""
    batch, q, kv_cache = mla_case([40, 7, 0], [1, 4, 3], 4, 4, 256, 16, torch.float32, device, tree=True)
    meta = triton_attention.prepare_attention(batch, 4, split_tokens=8)
    out = triton_attention.paged_latent_attention(q, kv_cache, 256, batch, meta, 0.1)
    assert_close(out.cpu(), dense_reference(q, _latent_rows(kv_cache, 256, device), batch, 4, 0.1, 256).float())
    ref = attention.paged_latent_attention(q, kv_cache, 256, batch, attention.prepare_attention(batch, 4), 0.1)
    assert_close(out, ref)
    assert latent_launches["_latent_partial_kernel"] == [(3, 1, 3)]  # 4 tokens x 4 heads: one row block


def test_tree_bits_pack_each_rows_draft_tree():
    """The latent kernel reads a row's draft tree as int32 bits (bit j: sees step token j); `short_query` past 31
    tokens would not fit and is refused by name."""
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1], [1, 0, 0]], dtype=torch.bool)
    assert triton_attention.tree_bits(tree, 16).tolist() == [1, 3, 5, 1]
    assert triton_attention.tree_bits(tree, 2).tolist() == [1, 3, 1, 1]
    with pytest.raises(ValueError, match="short_query"):
        triton_attention.tree_bits(tree, 32)
