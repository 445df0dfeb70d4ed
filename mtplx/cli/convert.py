"""`mtplx convert`: a GGUF (llama; Qwen3.5/3.6 keeping its nextn block as the MTP head), or a Hugging
Face checkpoint (quantized, keeping its MTP head), to an mlx-lm directory, written atomically."""

from __future__ import annotations

import argparse

from mtplx.cli.signals import terminate_as_exit

HELP = "a GGUF (llama, Qwen3.5/3.6 with its nextn head), or a Hugging Face checkpoint (quantized, keeping its MTP head), to an mlx-lm directory"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a .gguf file, or a Hugging Face checkpoint directory or repo id")
    parser.add_argument("out", help="output directory (written atomically)")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="GGUF: float32 | float16 | bfloat16 | q4; a Qwen3.5 GGUF also q2 | q3 | q5 | q6 | q8 (default float32)",
    )
    parser.add_argument("--q-bits", type=int, default=4, help="HF: trunk bits per weight (default 4)")
    parser.add_argument(
        "--q-group-size", type=int, default=64, help="HF, Qwen3.5 GGUF: quantization group size (default 64)"
    )
    parser.add_argument(
        "--head-bits",
        choices=["float", "2", "3", "4", "5", "6", "8"],
        default=None,
        help="HF, Qwen3.5 GGUF: the MTP head's bits, or float to keep it unquantized (default: attention, projection "
        "and dense parts at max(q-bits, 8), routed experts at q-bits)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")


def run(args: argparse.Namespace) -> int:
    with terminate_as_exit():  # the converters' ``finally`` blocks remove their temp directories
        return _convert(args)


def _convert(args: argparse.Namespace) -> int:
    head_bits = (
        None
        if args.head_bits is None
        else (args.head_bits if args.head_bits == "float" else int(args.head_bits))
    )
    if str(args.source).endswith(".gguf"):
        from mtplx.checkpoints.gguf_requantize import convert_gguf_file

        out = convert_gguf_file(
            args.source,
            args.out,
            dtype=args.dtype,
            overwrite=args.overwrite,
            q_group_size=args.q_group_size,
            head_bits=head_bits,
        )
    else:
        from mtplx.checkpoints.convert_hf import convert_hf

        out = convert_hf(
            args.source,
            args.out,
            q_bits=args.q_bits,
            q_group_size=args.q_group_size,
            head_bits=head_bits,
            overwrite=args.overwrite,
        )
    print(f"wrote {out}")
    return 0
