"""Helpers for test_forge: a tiny model directory as a user would have one, and a character tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

CHARS = list("abcdefghijklmnopqrstuvwxyz .,\n") + ["<unk>", "<|im_start|>", "<|im_end|>"]


class CharTokenizer:
    """One id per character (ids 0..25 = a..z): enough for ``prompt_ids`` on raw prompts."""

    def __init__(self, eos: int):
        self.eos_token_ids = [eos]

    def encode(self, text: str) -> list[int]:
        return [CHARS.index(c) for c in text]


def tiny_model_dir(path: Path, trunk) -> Path:
    """``trunk``'s weights saved as a llama checkpoint with a character-level tokenizer and a ChatML template."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "unk_token": "<unk>",
                "chat_template": template,
            }
        )
    )
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(trunk.model.parameters())))
    args = trunk.model.args
    config = {
        "model_type": "llama",
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_hidden_layers,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "rms_norm_eps": args.rms_norm_eps,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": bool(getattr(args, "tie_word_embeddings", True)),
        "rope_theta": 10000.0,
        "eos_token_id": vocab["<|im_end|>"],
    }
    (path / "config.json").write_text(json.dumps(config))
    return path
