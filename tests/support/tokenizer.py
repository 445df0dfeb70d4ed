"""Tokenizers for the tiny models, built with ``tokenizers`` (no download): a word-level one
saved beside a checkpoint, a printable-character one for prompts in plain text, and a ChatML
character one (with an in-memory twin) for the forge tests."""

from __future__ import annotations

import json
import string
from pathlib import Path

from support.models import VOCAB

CHATML_CHARS = list("abcdefghijklmnopqrstuvwxyz .,\n") + ["<unk>", "<|im_start|>", "<|im_end|>"]


def word_level(path: Path, vocab_size: int = VOCAB) -> None:
    """A whitespace word-level tokenizer over ``w0 .. w{vocab_size-1}`` (``w1`` = EOS) saved in
    ``path``, so ``Engine.load`` and ``mlx_lm.load`` open the checkpoint like a real one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "w1", "unk_token": "w0"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def printable_chars():
    """(tokenizer, vocabulary size): a ``PreTrainedTokenizerFast`` with one token per printable
    character but the rare whitespace ones, after ``<eos>`` (id 0): 97 tokens, any code or
    prose prompt encodes; its chat template writes ``<role>content`` lines."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return fast, len(vocab)


def printable_level(path: Path, vocab_size: int) -> None:
    """A character-level tokenizer saved in ``path`` for a checkpoint of ``vocab_size`` tokens:
    ``<unk>`` (0), ``<eos>`` (1, the replicas' ``eos_token_id``), then the printable characters
    but the rare whitespace ones and `` ` `` / ``~`` (94 in all), as many as fit; the chat
    template of `printable_chars`. A served replica then writes JSON (grammar rows)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c`~"][: vocab_size - 2]
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def chatml_chars(path: Path) -> int:
    """A character-level tokenizer over ``CHATML_CHARS`` with a ChatML template, saved in
    ``path``; returns the id of its EOS, ``<|im_end|>``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(CHATML_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return vocab["<|im_end|>"]


class CharTokenizer:
    """``chatml_chars`` in memory, one id per character (ids 0..25 = a..z): enough for
    ``prompt_ids`` on raw prompts; ``eos`` is its EOS id."""

    def __init__(self, eos: int):
        self.eos_token_ids = [eos]

    def encode(self, text: str) -> list[int]:
        return [CHATML_CHARS.index(c) for c in text]


THINKING_CHARS = [*CHATML_CHARS, "<think>", "</think>"]


def chatml_thinking_chars(path: Path) -> int:
    """``chatml_chars`` plus ``<think>`` / ``</think>`` (so mlx-lm sees a thinking model) and a
    Qwen3-style thinking template: the generation prompt opens ``<think>\\n``, and past assistant
    turns are rendered without it (a new turn rewrites the previous prompt's tail). Saved in
    ``path``; returns the vocabulary size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(THINKING_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # text decodes back to itself (no spaces between characters)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return len(vocab)
