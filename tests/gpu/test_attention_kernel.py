"""Our split-KV masked attention (ddtree.models.attention_kernel) compiled on the GPU at Qwen3.6-27B's attention dims
(24 query heads, 4 K/V heads of 256, bf16) against PyTorch's scaled_dot_product_attention in float32: an `ar` step's
one row, trees of 17 and 65 rows, batches of requests at scattered pool slots, short and long caches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from perf.attention_bench import tree_masks
from tests.triton_interpreter import attention_kernel_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("requests, rows, keys", [(1, 1, 1024), (1, 17, 1024), (1, 65, 520), (4, 17, 2048), (8, 5, 300)])
def test_compiled_masked_attention_equals_sdpa(requests, rows, keys):
    kernel = attention_kernel_module().masked_attention
    gen = torch.Generator().manual_seed(requests * 1000 + rows)
    heads, kv_heads, d = 24, 4, 256
    slots = torch.randperm(requests + 3, generator=gen)[:requests]
    pool_k, pool_v = (torch.randn(requests + 3, keys + 40, kv_heads, d, generator=gen) for _ in range(2))
    q = torch.randn(requests, rows, heads, d, generator=gen)
    mask = tree_masks(requests, rows, keys, gen)
    got = kernel(*(t.to("cuda", torch.bfloat16) for t in (q, pool_k, pool_v)), slots.cuda(), keys, mask.cuda(), d**-0.5)
    keys_, values = (pool[slots, :keys].transpose(1, 2) for pool in (pool_k, pool_v))
    want = F.scaled_dot_product_attention(q.transpose(1, 2), keys_, values, attn_mask=mask[:, None], scale=d**-0.5,
                                          enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2)
