"""Compile a request's `Grammar` against the model's tokenizer into a `GrammarConstraint`.

One llguidance tokenizer (``LLTokenizer``) per engine, built once (about a second for a 50k
vocabulary), and one matcher per request. The tokenizer comes from the Hugging Face fast tokenizer
through ``llguidance.hf.from_tokenizer`` (its Rust tokenizer's JSON, the route llguidance
documents); tokenizers whose decoder llguidance cannot read (character-level test tokenizers, for
one) fall back to a table of each token's bytes (``llguidance.TokenizerWrapper``), special tokens
marked with the 0xFF prefix llguidance uses for them. EOS: the engine's EOS ids, so the mask allows
them exactly where the grammar accepts.

Glossary: see `mtplx.engine.grammar_spec` (Grammar, source, field) and
`mtplx.spec_decode.constraint` (matcher, mask, stopped).
"""

from __future__ import annotations

from typing import Any

from mtplx.engine.grammar_spec import Grammar, llguidance_module
from mtplx.errors import MtplxError
from mtplx.spec_decode.constraint import GrammarConstraint, matcher_message

__all__ = ["GrammarCompiler"]


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper (or the tokenizer itself)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


class _ByteTable:
    """What ``llguidance.TokenizerWrapper`` reads: every token's bytes, EOS/BOS, special ids, encode."""

    def __init__(self, hf: Any, eos: int):
        size = len(hf)
        special = set(getattr(hf, "all_special_ids", ()))
        self.eos_token_id = eos
        self.bos_token_id = getattr(hf, "bos_token_id", None)
        self.special_token_ids = sorted(special)
        self.tokens = [
            b"\xff" + str(hf.convert_ids_to_tokens(i)).encode() if i in special else hf.decode([i]).encode()
            for i in range(size)
        ]
        self._hf = hf

    def __call__(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False)


def build_llguidance_tokenizer(tokenizer: Any, eos_token_ids: list[int]) -> Any:
    """An ``LLTokenizer`` for ``tokenizer`` (mlx-lm's wrapper or a HF fast tokenizer)."""
    llguidance = llguidance_module()
    hf = _hf_tokenizer(tokenizer)
    try:
        import llguidance.hf as llg_hf

        return llg_hf.from_tokenizer(hf, eos_token=eos_token_ids)
    except (ValueError, TypeError, ImportError):
        pass  # a decoder llguidance cannot read: describe every token by its bytes instead
    try:
        wrapper = llguidance.TokenizerWrapper(_ByteTable(hf, eos_token_ids[0]))
        return llguidance.LLTokenizer(wrapper, eos_token=eos_token_ids)
    except Exception as error:  # llguidance raises plain exceptions for unusable vocabularies
        raise MtplxError(f"grammar: this model's tokenizer cannot be used for grammars ({error})") from None


class GrammarCompiler:
    """Compiles grammars for one engine: its tokenizer (built at first use) and vocabulary size."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(int(t) for t in tokenizer.eos_token_ids)
        self._ll_tokenizer = None

    @property
    def ll_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            if not self.eos_token_ids:
                raise MtplxError("grammar: the model's tokenizer has no EOS token to end a grammar with")
            self._ll_tokenizer = build_llguidance_tokenizer(self.tokenizer, self.eos_token_ids)
        return self._ll_tokenizer

    def compile(self, grammar: Grammar) -> GrammarConstraint:
        """A fresh matcher for ``grammar`` at the start of the output; `MtplxError` naming the
        grammar's field if it cannot be compiled for this vocabulary."""
        llguidance = llguidance_module()
        ll_tokenizer = self.ll_tokenizer
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar.source, log_level=0)
        if matcher.is_error():
            raise MtplxError(f"{grammar.field}: {matcher_message(matcher.get_error())}")
        return GrammarConstraint(matcher, self.vocab_size, ll_tokenizer.vocab_size, self.eos_token_ids)
