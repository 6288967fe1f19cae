"""benchmarks/deepseek_v4_memory.py on the official V4-Flash shapes (built on the meta device): the compressed rows
and the window are priced per block of their own pool, so a sequence's KV bytes per token of context are the rows'
plus its window's few blocks, about a twelfth of DeepSeek-V3.2's at 128k tokens."""

from __future__ import annotations

import torch

from .scripts import load_script


def test_v4_flash_kv_bytes_per_token_of_context_against_v32() -> None:
    bench = load_script("deepseek_v4_memory")
    out = bench.report(8, torch.bfloat16, 64)
    full, sliding = out["kv_groups"]["full"], out["kv_groups"]["sliding"]
    # per token of context: 20 CSA layers a 512-wide row and a 128-wide index key per 4 tokens, 23 HCA layers a
    # 512-wide row per 128 tokens, kept one per 64-token block (rate > block size): 2 bytes each
    assert full["bytes_per_token_held"] == 2 * (20 * (512 + 128) / 4 + 23 * 512 / 64) == 6768
    assert full["bytes_per_block"] == 64 * 6768 and full["pool"] != sliding["pool"]
    # the window's 128 tokens hold per token each layer's 512-wide row and its compressors' inputs
    assert sliding["bytes_per_token_held"] == 2 * (43 * 512 + 20 * (4 * 512 + 4 * 128) + 23 * 2 * 512) == 193536
    assert sliding["bytes_per_block"] == 64 * 193536
    # at 128k the sequence holds 2049 row blocks and 3 window blocks
    assert out["kv_bytes_per_token_of_context"]["131072"] == round((2049 * 64 * 6768 + 3 * 64 * 193536) / 131072)
    assert out["deepseek_v32_kv_bytes_per_token"] == 85888
    assert out["ratio_to_deepseek_v32"]["131072"] < 0.085 and out["ratio_to_deepseek_v32"]["32768"] < 0.1
    # the release's FP4 experts, kept packed: per rank 256 experts x 43 layers x 3 projections of 2048 / 8 x 4096
    # values, half a byte each and a one-byte scale per 32
    assert out["routed_experts"] == "fp4"
    assert out["routed_expert_bytes_rank0"] == 256 * 43 * 3 * (2048 // 8) * 4096 * (1 / 2 + 1 / 32)
