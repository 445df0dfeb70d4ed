"""User data for `mtplx forge`: text and chat files, read into samples the prompt builder turns into prompts.

Accepted: ``.txt``/``.md``/``.rst``/``.py`` files (split into passages at blank lines)
and ``.jsonl`` files of ``{"text": ...}`` or ``{"messages": [{"role", "content"}, ...]}``.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from mtplx.errors import MtplxError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
_PASSAGE_CHARS = 4000


@dataclass(frozen=True)
class Sample:
    """One training document: plain text, or chat messages for the tokenizer's template."""

    source: str  # corpus-relative file name
    text: str = ""
    messages: tuple[tuple[str, str], ...] = ()  # (role, content) pairs; non-empty = chat

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)


@dataclass
class Corpus:
    train: list[Sample]
    eval: list[Sample]
    description: str
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)


def unit_hash(key: str) -> float:
    """A stable number in [0, 1) for ``key`` (sha256), used for splits and choices."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64


def split_passages(text: str, max_chars: int = _PASSAGE_CHARS, boundary: str = r"\n\s*\n") -> list[str]:
    """Cut ``text`` into pieces of at most ~max_chars at blank-line (or given) boundaries."""
    pieces = [p for p in re.split(f"({boundary})", text)]
    out: list[str] = []
    current = ""
    for piece in pieces:
        if len(current) + len(piece) > max_chars and current.strip():
            out.append(current.strip("\n"))
            current = ""
        current += piece
        while len(current) > 2 * max_chars:  # a single huge block: hard cut
            out.append(current[:max_chars])
            current = current[max_chars:]
    if current.strip():
        out.append(current.strip("\n"))
    return out


def stdlib_dir() -> Path:
    """The running interpreter's standard library (the base one, not a venv's)."""
    return Path(
        sysconfig.get_paths(vars={"base": sys.base_prefix, "installed_base": sys.base_prefix})["stdlib"]
    )


# ---------------------------------------------------------------- user data


def _read_jsonl(path: Path) -> list[Sample]:
    """Lines of {"text": ...} or {"messages": [{"role", "content"}, ...]}."""
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "messages" in row:
                msgs = tuple((str(m["role"]), str(m["content"])) for m in row["messages"])
                out.append(Sample(str(path), messages=msgs))
            else:
                out.append(Sample(str(path), text=str(row["text"])))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise MtplxError(
                f"{path}:{lineno}: expected a JSON object with 'text' or 'messages' ({err})"
            ) from None
    return out


def _user_files(paths: list[Path]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES))
        elif p.is_file():
            files.append(p)
        else:
            raise MtplxError(f"{p}: training data not found")
    return files


def corpus_from_paths(paths: list[str | Path], eval_fraction: float = 0.08) -> Corpus:
    """A corpus from user text files / directories / .jsonl chat files; errors on nothing usable."""
    if not paths:
        raise MtplxError("forge: no training data given")
    files = _user_files([Path(p) for p in paths])
    if not files:
        raise MtplxError(f"{paths[0]}: no training files ({', '.join(TEXT_SUFFIXES)}) found")
    samples: list[Sample] = []
    for f in files:
        if f.suffix == ".jsonl":
            samples.extend(_read_jsonl(f))
        else:
            try:
                text = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise MtplxError(f"{f}: unreadable training file ({err.__class__.__name__})") from None
            samples.extend(Sample(str(f), text=p) for p in split_passages(text))
    samples = [s for s in samples if s.text.strip() or s.messages]
    if not samples:
        raise MtplxError(f"{files[0]}: training data is empty")
    # With few files, split passages rather than files so both sides get something.
    evals = [s for i, s in enumerate(samples) if unit_hash(f"split:{s.source}#{i}") < eval_fraction]
    train = [s for i, s in enumerate(samples) if unit_hash(f"split:{s.source}#{i}") >= eval_fraction]
    if not train:
        train, evals = samples, []
    return Corpus(
        train,
        evals,
        f"user files: {', '.join(str(p) for p in paths)}",
        sorted({s.source for s in train}),
        sorted({s.source for s in evals}),
    )
