"""The blackwell_moe plugin's environment variables (FastDeploy's names where FastDeploy has one)."""

from __future__ import annotations

from fdplug.plugin_api.settings import Setting, parse_bool, parse_positive_int

USE_DEEP_GEMM = Setting("FD_USE_DEEP_GEMM", True, parse_bool,
                        "1 (default): the blackwell_fp8 MoE backend may run on DeepGEMM's grouped FP8 GEMMs; 0 turns "
                        "it off (selection says so).")
DISPATCH_TOKENS = Setting("FDPLUG_NUM_MAX_DISPATCH_TOKENS_PER_RANK", None, parse_positive_int,
                          "FastDeploy's num_max_dispatch_tokens_per_rank for blackwell_fp8: rows per expert of the "
                          "masked layout decode steps use (default max_num_seqs x (speculative tokens + 1)); must be "
                          ">= max_num_seqs.")

SETTINGS = (USE_DEEP_GEMM, DISPATCH_TOKENS)
