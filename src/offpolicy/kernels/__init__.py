"""Chunked fused (hidden states × lm_head) → per-token log-prob, entropy, DVP min-p statistics and KL to the rollout.

Never materialises an ``[N, V]`` tensor; see :mod:`offpolicy.kernels.fused` for the mathematics and
:mod:`offpolicy.kernels.chunking` for how the chunk size follows from a memory budget; :mod:`offpolicy.kernels.row_maps`
for statistics of whole logit rows (sampling replay, score centering) mapped over row chunks.
"""

from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES, chunk_rows, row_chunks
from offpolicy.kernels.fused import TokenStats, fused_logp, fused_token_stats, token_stats_from_logits
from offpolicy.kernels.fused_tiles import DIFF_OUTPUTS, IGNORE_INDEX
from offpolicy.kernels.row_maps import head_logits, head_row_map, logits_row_map

__all__ = [
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "DIFF_OUTPUTS",
    "IGNORE_INDEX",
    "TokenStats",
    "chunk_rows",
    "fused_logp",
    "fused_token_stats",
    "head_logits",
    "head_row_map",
    "logits_row_map",
    "row_chunks",
    "token_stats_from_logits",
]
