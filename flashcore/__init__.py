"""flashcore: append-and-attend over a preallocated KV cache, on Triton kernels.

The contract lives in :func:`flashcore.attention_with_kv_cache`.
"""

from flashcore.cache import KVCache, allocate_kv_cache, cached_keys_values, reset_kv_cache, rollback
from flashcore.ops import attention_with_kv_cache

__version__ = "0.1.0"

__all__ = [
    "KVCache",
    "__version__",
    "allocate_kv_cache",
    "attention_with_kv_cache",
    "cached_keys_values",
    "reset_kv_cache",
    "rollback",
]
