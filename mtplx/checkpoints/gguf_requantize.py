"""`mtplx convert FILE.gguf`: every GGUF conversion, requantized ones included.

A llama GGUF converts in ``convert_gguf`` at any of its dtypes. A Qwen3.5 / 3.6 GGUF
(``gguf_qwen35``) converts to float there; for ``q<bits>`` that float directory (bfloat16, as
``mlx_lm.convert`` casts a bf16 checkpoint) is written beside the output and quantized by
``convert_hf`` (mlx-lm's quantizer at ``q_group_size``, the nextn head at ``head_bits``: None is
``mtplx.heads.precision``'s default), then dropped. This module sits above both converters so
neither imports the other's caller.

Invariant: the output directory appears atomically (``convert_hf``'s rename) or not at all; the
float directory never outlives the call.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mtplx.checkpoints import gguf_qwen35
from mtplx.checkpoints.convert_gguf import DTYPES, FLOAT_DTYPES, convert_gguf
from mtplx.checkpoints.convert_hf import convert_hf
from mtplx.checkpoints.gguf import check_architecture, read_gguf
from mtplx.checkpoints.output_dir import check_output_dir
from mtplx.errors import MtplxError
from mtplx.io import atomic_write

QUANTIZED_DTYPES = ("q2", "q3", "q4", "q5", "q6", "q8")  # convert_hf's widths
QWEN35_DTYPES: tuple[str, ...] = (*FLOAT_DTYPES, *QUANTIZED_DTYPES)


def convert_gguf_file(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    q_group_size: int = 64,
    head_bits: Any = None,
    float_dtype: str = "bfloat16",
) -> Path:
    """Convert any supported GGUF (see the module docstring); returns the output directory.
    ``float_dtype``: the float directory a ``q<bits>`` conversion quantizes (and so the dtype of
    the scales, biases and unquantized layers); bfloat16 as mlx-community's models, float32 where
    bfloat16 arithmetic is slow (MLX on a CPU)."""
    offered = sorted(set(DTYPES) | set(QWEN35_DTYPES), key=lambda d: (d[0] == "q", d))
    if dtype not in offered:
        raise MtplxError(f"unsupported dtype {dtype!r} (choose from {', '.join(offered)})")
    out_dir = check_output_dir(out_dir, overwrite, inputs=[gguf_path])
    gguf = read_gguf(gguf_path)
    check_architecture(gguf)
    if gguf.architecture not in gguf_qwen35.ARCHITECTURES or dtype in FLOAT_DTYPES:
        if dtype not in DTYPES:
            raise MtplxError(
                f"{gguf.path}: dtype {dtype!r} is not offered for a {gguf.architecture} GGUF (choose from {', '.join(DTYPES)})"
            )
        return convert_gguf(gguf_path, out_dir, dtype=dtype, overwrite=overwrite)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.float-", dir=out_dir.parent))
    try:
        float_dir = convert_gguf(gguf_path, tmp / "float", dtype=float_dtype)
        convert_hf(
            float_dir,
            out_dir,
            q_bits=int(dtype[1:]),
            q_group_size=q_group_size,
            head_bits=head_bits,
            overwrite=overwrite,
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _mark(out_dir, gguf.path.name, dtype)
    return out_dir


def _mark(out_dir: Path, source: str, dtype: str) -> None:
    """The config's ``mtplx`` block names the GGUF (``convert_hf`` named the float directory)."""
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["mtplx"].update({"converted_from": source, "dtype": dtype})
    with atomic_write(config_path) as handle:
        handle.write(json.dumps(config, indent=4) + "\n")
