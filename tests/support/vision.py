"""A tiny random-weight Qwen3.5 vision-language checkpoint, written as the published ones are, made
offline: config.json with ``text_config`` and ``vision_config``, Hugging Face tensor names
(``model.language_model.*``, ``model.visual.*`` with the torch Conv3d layout, ``lm_head``,
``mtp.*``) or mlx-vlm's converted names (``language_model.*``, ``vision_tower.*``), a
preprocessor_config.json, and a character tokenizer whose last ids are the vision specials.

Sizes: text hidden 32, 4 layers (gated delta, attention, gated delta, attention), 2 attention
heads of 16 with half of each rotated (8 rotary dims: 4 frequencies, M-RoPE sections [2, 1, 1]
so every axis drives one); vision tower of depth 1, patch 4, merge 2. An image of W x H pixels
(multiples of 8) gives (H / 8) x (W / 8) language tokens.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from support.checkpoints import Tiny, _prefixed, _qwen35_offset, _qwen_next_head_module, write_checkpoint
from support.models import HIDDEN, VOCAB, qwen3_5_mtp_layer, randomize, scale_outputs

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = VOCAB - 4, VOCAB - 3, VOCAB - 2, VOCAB - 1
SPECIALS = {
    VISION_START: "<|vision_start|>",
    VISION_END: "<|vision_end|>",
    IMAGE_PAD: "<|image_pad|>",
    VIDEO_PAD: "<|video_pad|>",
}
EOS = 1  # "a"
CHARS = "!abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456"  # ids 0 .. VOCAB - 5
PREPROCESSOR = {
    "patch_size": 4,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 64, "longest_edge": 48 * 48},
}


def vlm_config(
    mtp_layers: int = 1,
    moe: bool = False,
    head_dim: int = 16,
    patch_size: int = 4,
    temporal_patch_size: int = 2,
) -> dict:
    """The config.json; ``moe``: Qwen3.5-MoE's (4 routed experts, 2 per token, a shared expert);
    ``head_dim`` 32 fits quantized KV's groups (M-RoPE sections scaled with it); the tower's
    ``patch_size`` and ``temporal_patch_size``."""
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "tie_word_embeddings": False,
        "max_position_embeddings": 1024,
        "eos_token_id": EOS,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2 * head_dim // 16, head_dim // 16, head_dim // 16],
            "mrope_interleaved": True,
        },
    }
    if mtp_layers:
        text["mtp_num_hidden_layers"] = mtp_layers
    if moe:
        text.update(
            model_type="qwen3_5_moe_text",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            decoder_sparse_step=1,
        )
    family = "qwen3_5_moe" if moe else "qwen3_5"
    vision = {
        "model_type": family,
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_heads": 2,
        "out_hidden_size": HIDDEN,
        "patch_size": patch_size,
        "temporal_patch_size": temporal_patch_size,
        "spatial_merge_size": 2,
        "in_channels": 3,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [],
    }
    return {
        "model_type": family,
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "image_token_id": IMAGE_PAD,
        "video_token_id": VIDEO_PAD,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
        "eos_token_id": EOS,
    }


def _vision_tower(config: dict, seed: int):
    import importlib

    vlm = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")

    tower = vlm.VisionModel(vlm.ModelConfig.from_dict(json.loads(json.dumps(config))).vision_config)
    randomize(tower, seed)
    return tower


def _hf_experts(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm's stacked ``switch_mlp`` projections as Hugging Face's fused Qwen3.5-MoE experts
    (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])."""
    out = {}
    for name, v in tensors.items():
        if ".switch_mlp.up_proj." in name or ".switch_mlp.down_proj." in name:
            continue
        if ".switch_mlp.gate_proj." in name:
            prefix = name.split(".switch_mlp.")[0]
            up = tensors[name.replace("gate_proj", "up_proj")]
            out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([v, up], axis=-2)
            out[f"{prefix}.experts.down_proj"] = tensors[name.replace("gate_proj", "down_proj")]
            continue
        out[name] = v
    return out


def write_vlm(
    path: Path,
    *,
    layout: str = "hf",
    mtp_layers: int = 1,
    seed: int = 0,
    moe: bool = False,
    context_strength: float | None = None,
    head_dim: int = 16,
    patch_size: int = 4,
    temporal_patch_size: int = 2,
) -> Tiny:
    """The checkpoint in ``layout`` "hf" (published) or "mlx-vlm" (converted), with its
    preprocessor config and tokenizer; ``moe``: Qwen3.5-MoE (no MTP head). ``context_strength``
    as `support.checkpoints.qwen3_5`'s: a head that reads the next token's embedding, so it
    agrees with the trunk's bigram part (drafts get kept), for acceptance measurements;
    ``head_dim``, ``patch_size``, ``temporal_patch_size`` as `vlm_config`'s."""
    import importlib

    config = vlm_config(0 if moe else mtp_layers, moe, head_dim, patch_size, temporal_patch_size)
    q = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = q.Model(q.ModelArgs.from_dict(json.loads(json.dumps(config))))
    randomize(model, seed)
    if context_strength is not None:
        scale_outputs(model, context_strength)
        embed = model.language_model.model.embed_tokens
        embed.weight = embed.weight * embed.weight.shape[-1] ** 0.5
    tower = _vision_tower(config, seed + 2)
    tensors: dict[str, mx.array] = {}
    for name, v in tree_flatten(model.parameters()):
        if layout == "mlx-vlm":
            tensors[name] = v
            continue
        if name.startswith("language_model.model."):
            hf = "model.language_model." + name[len("language_model.model.") :]
        else:
            hf = name[len("language_model.") :]  # lm_head.weight
        if "conv1d.weight" in name:
            v = v.moveaxis(2, 1)  # mlx [C, K, 1] -> torch [C, 1, K]
        tensors[hf] = _qwen35_offset(hf, v)
    for name, v in tree_flatten(tower.parameters()):
        if layout == "mlx-vlm":
            tensors["vision_tower." + name] = v
        else:
            tensors["model.visual." + name] = (
                v.transpose(0, 4, 1, 2, 3) if name == "patch_embed.proj.weight" else v
            )
    if moe and layout == "hf":
        tensors = _hf_experts(tensors)
    if mtp_layers and not moe:
        head = _qwen_next_head_module([qwen3_5_mtp_layer(model) for _ in range(mtp_layers)])
        randomize(head, seed + 1)
        if context_strength is not None:
            scale_outputs(head, context_strength)
            head.fc.weight = mx.concatenate([mx.eye(HIDDEN), mx.zeros((HIDDEN, HIDDEN))], axis=1)
            head.pre_fc_norm_embedding.weight = mx.ones((HIDDEN,))
            head.norm.weight = model.language_model.model.norm.weight
        for name, v in _prefixed(head, "mtp.").items():
            tensors[name] = _qwen35_offset(name, v) if layout == "hf" else v
    tiny = write_checkpoint(path, tensors, config)
    preprocessor = {**PREPROCESSOR, "patch_size": patch_size, "temporal_patch_size": temporal_patch_size}
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    vision_tokenizer(path)
    return tiny


def vision_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer with one token per character of ``CHARS`` (ids 0..59; "a" = 1
    is the EOS) and the four vision specials, whose chat template writes an image part as
    ``<|vision_start|><|image_pad|><|vision_end|>`` and opens the assistant's turn with "Z". (A BPE one:
    transformers loads a Qwen3.5 checkpoint's tokenizer as its own BPE class whatever the
    tokenizer config says.)"""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(SPECIALS[i], special=True) for i in sorted(SPECIALS)])
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}Z{% endif %}"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}{% if part['type'] in ('image', 'image_url') %}"
        "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}"
        "{% endif %}{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}Z{% endif %}"
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": CHARS[EOS],
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def made_up_image(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """An image file (``fmt``) of smooth gradients plus seeded noise: every pixel differs."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def reference_vlm(path: Path):
    """mlx-vlm's own Qwen3.5 model (tower and language model) loaded from the checkpoint at ``path``."""
    import importlib

    config = json.loads((path / "config.json").read_text())
    vlm = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    model = vlm.Model(vlm.ModelConfig.from_dict(config))
    weights = {}
    for file in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(file)))
    weights = model.sanitize(weights)  # then each part's own, as mlx_vlm.utils.load_model does
    weights = model.vision_tower.sanitize(weights)
    if hasattr(model.language_model, "sanitize"):
        weights = model.language_model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model
