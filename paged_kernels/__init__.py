"""paged-kernels: PagedAttention over a block-table KV cache, with interchangeable backends.

The public API lives in `paged_kernels.attention` (docs/abi.md states the ABI); the same
operations as torch custom operators, for `torch.compile` and CUDA graphs, in
`paged_kernels.custom_ops`.
"""

from paged_kernels.abi import AttentionProblem, Support
from paged_kernels.attention import (
    AttentionPlan,
    copy_blocks,
    merge_attn_states,
    paged_attention,
    plan,
    swap_blocks,
    write_kv,
)
from paged_kernels.backends import (
    Backend,
    BackendUnavailable,
    available_backends,
    get_backend,
    registered_backends,
    resolve_backend,
    unavailable_backends,
)
from paged_kernels.cache_memory import empty_cache, prefault, zeros_cache

# registers torch.ops.paged_kernels.{paged_attention, write_kv} (torch.compile, CUDA graphs)
from paged_kernels import custom_ops  # noqa: E402,F401  isort: skip

__version__ = "0.1.0"

__all__ = [
    "AttentionPlan", "AttentionProblem", "Backend", "BackendUnavailable", "Support",
    "available_backends", "copy_blocks", "empty_cache", "get_backend", "merge_attn_states",
    "paged_attention", "plan", "prefault", "registered_backends", "resolve_backend", "swap_blocks",
    "unavailable_backends", "write_kv", "zeros_cache",
]
