"""The blackwell_moe plugin's environment variables (FastDeploy's names where FastDeploy has one)."""

from __future__ import annotations

from fdplug.plugin_api.settings import Setting, parse_bool, parse_positive_int

USE_DEEP_GEMM = Setting("FD_USE_DEEP_GEMM", True, parse_bool,
                        "1 (default): the blackwell_fp8 MoE backend may run on DeepGEMM's grouped FP8 GEMMs; 0 turns "
                        "it off (selection says so).")
USE_BLACKWELL_GEMM = Setting("FD_USE_BLACKWELL_GEMM", False, parse_bool,
                             "1: dense FP8 linears run as DeepGEMM fp8_gemm_nt on Blackwell (blackwell_fp8_linear; "
                             "needs FD_USE_DEEP_GEMM=1); "
                                 "0 (default, as in FastDeploy): they stay on the portable path.")
DISPATCH_TOKENS = Setting("FDPLUG_NUM_MAX_DISPATCH_TOKENS_PER_RANK", None, parse_positive_int,
                          "FastDeploy's num_max_dispatch_tokens_per_rank for blackwell_fp8: rows per expert of the "
                          "masked layout decode steps use (default max_num_seqs x (speculative tokens + 1)); must be "
                          ">= max_num_seqs.")

SETTINGS = (USE_DEEP_GEMM, USE_BLACKWELL_GEMM, DISPATCH_TOKENS)
