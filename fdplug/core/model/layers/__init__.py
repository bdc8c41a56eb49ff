"""The network, in plain Paddle ops every device runs: the decoder (dense and MoE), its linears in
each weight format (float, FP8 blocks, GGML blocks) and small blocks, running the selected op kernels."""
