"""Quantize a float checkpoint into the FP8 block format (DeepSeek-V3 / HF FP8: e4m3 + weight_scale_inv).

    python tools/make_fp8_checkpoint.py SRC DST [--block 128 128] [--keep lm_head --keep model.layers.0.]
        [--dequantized DIR]      # also the quantized weights back in float32: the FP8 model's float twin

Example, a tiny Qwen3-MoE served in FP8:

    python -c "from fdplug.demo.random_model import write_random_model as w; from pathlib import Path; \\
      p = Path('/tmp/q3moe'); p.mkdir(); w(p, architectures=['Qwen3MoeForCausalLM'], num_experts=8, \\
      num_experts_per_tok=2, moe_intermediate_size=64, hidden_size=128, num_attention_heads=4, head_dim=32)"
    python tools/make_fp8_checkpoint.py /tmp/q3moe /tmp/q3moe-fp8 --dequantized /tmp/q3moe-fp8-float
    fdplug serve --model /tmp/q3moe-fp8
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fdplug.core.quant.checkpoint import quantize_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"))
    parser.add_argument("--keep", action="append", default=[], help="module name fragment left in float (repeatable)")
    parser.add_argument("--dequantized", type=Path, help="also write the dequantized float32 checkpoint here")
    args = parser.parse_args()
    count = quantize_checkpoint(args.src, args.dst, block=tuple(args.block), keep=tuple(args.keep),
                                dequantized=args.dequantized)
    print(f"{count} linear weights quantized to FP8 ({args.block[0]}x{args.block[1]} blocks) -> {args.dst}")


if __name__ == "__main__":
    main()
