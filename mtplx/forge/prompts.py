"""Prompts the trunk answers to make `mtplx forge`'s training data, and the held-out check.

A head drafts well when it has seen text distributed like what the trunk itself
writes, in the situations it will be asked to draft in. So forge does not train on
human text: it asks the trunk to write, and these are the requests. The default
set is built offline from text every Python install has, in the shapes users
send: instructions, code questions, "explain this code", multi-turn chat (through
the chat template), requests that hand it text to rework or quote ("grounded":
the answer copies much of the prompt), and raw continuations of code and prose.
Raw continuations make up about half of what fits, as in the benchmark suite (the
first forged head's data held 14%: most continuation prompts exceeded ``max_prompt``).

* CPython's top-level standard library files (``Lib/*.py``; the benchmark suite
  takes its code from sub-packages, which are never read here): functions and
  classes with docstrings (via ``ast``) give code questions, explanations,
  instructions, follow-up turns and raw code continuations; module docstrings
  give prose continuations.
* The Python language reference as every CPython install ships it
  (``pydoc_data/topics.py``, the text ``help("topic")`` prints): prose
  continuations and quote/summarize requests.
* Debian's package documentation (``/usr/share/doc/*/README*``, ``*.md``,
  ``*.txt``; uncompressed files only): prose continuations, summarize and quote requests.

User data (``--data``) is turned into prompts the same way: chat samples keep
their user turns (the last assistant turn is dropped: the trunk writes it), text
passages become continuation prefixes.

``check_held_out`` refuses a prompt set that shares a line (or the whole text)
with the held-out benchmark prompts, by sha256, so acceptance measured on those
prompts is never measured on training data.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mtplx.errors import MtplxError
from mtplx.forge.corpus import Sample, split_passages, stdlib_dir, unit_hash

DEBIAN_DOC_DIR = Path("/usr/share/doc")
KINDS = (
    "instruction",
    "code_question",
    "explanation",
    "multi_turn",
    "grounded",
    "code_continuation",
    "prose_continuation",
)
_MIN_HELD_OUT_LINE = 24  # shorter lines ("return result") are common to any code and prove nothing


@dataclass(frozen=True)
class Prompt:
    """One request to the trunk: chat turns (through its template) or raw text to continue."""

    kind: str
    source: str  # where it came from (file and name), recorded in shards for provenance
    text: str = ""
    messages: tuple[tuple[str, str], ...] = ()  # (role, content); non-empty = chat

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)

    def all_text(self) -> str:
        return self.text if not self.messages else "\n".join(c for _, c in self.messages)


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids exactly as the engine encodes the same request (``Engine.encode_prompt``)."""
    if prompt.is_chat:
        ids = tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in prompt.messages], add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    return list(tokenizer.encode(prompt.text))


# ---------------------------------------------------------------- the default set

_INSTRUCTIONS = (
    "What does `{q}` do in Python?",
    "How do I use `{q}`? Give a short example.",
    "Explain `{q}` to a beginner.",
    "When should I use `{q}`, and what are the pitfalls?",
)
_CODE_QUESTIONS = (
    "Write a Python function `{sig}` that does the following: {doc}",
    "Implement `{sig}` in Python. {doc}",
    "Can you write a function `{sig}`? It should work like this: {doc}",
)
_FOLLOW_UPS = (
    "Can you show me an example?",
    "Summarize that in two sentences.",
    "What are common mistakes with it?",
    "How would I test that?",
    "Can you rewrite that more simply?",
)
_SUMMARIZE = (
    "Summarize this text:\n\n{t}",
    "What is this text about?\n\n{t}",
    "Rewrite this in plain words:\n\n{t}",
)
# Grounded requests: the answer reuses much of the given text (what prompt lookup drafts well).
_CODE_EDITS = (
    "Add type hints to this function and return the whole function:\n\n```python\n{body}\n```",
    "Rewrite this code with clearer variable names. Return only the code.\n\n```python\n{body}\n```",
    "Add a comment above each step of this code and return it:\n\n```python\n{body}\n```",
    "Check this function for bugs and return a corrected version:\n\n```python\n{body}\n```",
)
_QUOTES = (
    "Which sentences of this text matter most? Quote them exactly.\n\n{t}",
    "Give the main points of this text, citing its own words:\n\n{t}",
)
_GROUNDED_LINES = 25  # function bodies handed to the trunk; longer ones would not fit max_prompt


def _pick(options: Sequence[str], key: str) -> str:
    return options[int(unit_hash("q:" + key) * len(options))]


def _first_sentence(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    text = " ".join(para.split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return (match.group(1) if match else text)[:300]


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = [a.arg for a in node.args.args]
    return f"{node.name}({', '.join(args)})"


def _code_prompts(path: Path, label: str) -> list[Prompt]:
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    module = path.stem
    out: list[Prompt] = []
    module_doc = ast.get_docstring(tree)
    if module_doc and len(module_doc) > 200:
        out.append(
            Prompt("prose_continuation", f"{label}:__doc__", text=module_doc[: 200 + len(module_doc) // 3])
        )
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        doc = ast.get_docstring(node)
        if not doc or node.name.startswith("__") or len(doc) < 40:
            continue
        key = f"{label}:{node.name}:{node.lineno}"
        qual = f"{module}.{node.name}"
        choice = unit_hash("kind:" + key)
        short_body = "\n".join(
            lines[node.lineno - 1 : min(node.end_lineno or node.lineno, node.lineno + _GROUNDED_LINES)]
        )
        if isinstance(node, ast.ClassDef):
            choice = 0.0 if choice < 0.4 else 1.0  # instruction or continuation: no signature to ask for
        if choice < 0.12:
            out.append(
                Prompt("instruction", key, messages=(("user", _pick(_INSTRUCTIONS, key).format(q=qual)),))
            )
        elif choice < 0.24:
            question = _pick(_CODE_QUESTIONS, key).format(sig=_signature(node), doc=_first_sentence(doc))
            out.append(Prompt("code_question", key, messages=(("user", question),)))
        elif choice < 0.32:
            ask = f"Explain what this Python code does:\n\n```python\n{short_body}\n```"
            out.append(Prompt("explanation", key, messages=(("user", ask),)))
        elif choice < 0.42:
            ask = _pick(_CODE_EDITS, key).format(body=short_body)
            out.append(Prompt("grounded", key, messages=(("user", ask),)))
        elif choice < 0.52:
            turns = (
                ("user", _pick(_INSTRUCTIONS, key).format(q=qual)),
                ("assistant", " ".join(doc.split())[:600]),
                ("user", _pick(_FOLLOW_UPS, key)),
            )
            out.append(Prompt("multi_turn", key, messages=turns))
        else:
            # The lines before the definition, its signature and docstring: continue the body.
            start = max(0, node.lineno - 1 - 12)
            doc_end = node.body[0].end_lineno if node.body else node.lineno
            text = "\n".join(lines[start:doc_end]) + "\n"
            out.append(Prompt("code_continuation", key, text=text))
    return out


def _passage_prompts(passages: Sequence[str], label: str) -> list[Prompt]:
    """Prose continuations (60%), summarize (20%) and quote (20%) requests from passages of a text."""
    out: list[Prompt] = []
    for i, passage in enumerate(passages):
        if len(passage) < 300:
            continue
        key = f"{label}#{i}"
        choice = unit_hash("kind:" + key)
        if choice < 0.6:
            out.append(Prompt("prose_continuation", key, text=passage[: len(passage) * 2 // 3]))
        elif choice < 0.8:
            ask = _pick(_SUMMARIZE, key).format(t=passage)
            out.append(Prompt("instruction", key, messages=(("user", ask),)))
        else:
            ask = _pick(_QUOTES, key).format(t=passage)
            out.append(Prompt("grounded", key, messages=(("user", ask),)))
    return out


def _debian_prompts(root: Path) -> list[Prompt]:
    out: list[Prompt] = []
    patterns = ("README*", "*.md", "*.txt")
    files = sorted({f for p in patterns for f in root.glob(f"*/{p}") if f.is_file() and f.suffix != ".gz"})
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out.extend(
            _passage_prompts(split_passages(text, max_chars=1000)[:3], f"debian-doc/{f.relative_to(root)}")
        )
    return out


def _reference_prompts(stdlib: Path) -> list[Prompt]:
    """The language reference's topics (``pydoc_data/topics.py``: a dict literal, read without importing it)."""
    path = stdlib / "pydoc_data" / "topics.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        topics = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, StopIteration):
        return []
    if not isinstance(topics, dict):
        return []
    out: list[Prompt] = []
    for name in sorted(topics):
        text = str(topics[name])
        out.extend(_passage_prompts(split_passages(text, max_chars=1000)[:6], f"pydoc-topics/{name}"))
    return out


def default_prompts(
    stdlib: Path | None = None, debian_doc: Path | None = DEBIAN_DOC_DIR
) -> tuple[list[Prompt], str]:
    """The offline default prompt set and its description (for the manifest)."""
    stdlib = stdlib or stdlib_dir()
    prompts: list[Prompt] = []
    for f in sorted(stdlib.glob("*.py")):  # top level only: the benchmark's code is in sub-packages
        prompts.extend(_code_prompts(f, f"stdlib/{f.name}"))
    parts = [f"CPython stdlib ({stdlib}/*.py, top level)"]
    reference = _reference_prompts(stdlib)
    if reference:
        prompts.extend(reference)
        parts.append(f"the language reference ({stdlib}/pydoc_data/topics.py)")
    if debian_doc is not None and debian_doc.is_dir():
        prompts.extend(_debian_prompts(debian_doc))
        parts.append(f"Debian package docs ({debian_doc}/*/README*, *.md, *.txt)")
    if not prompts:
        raise MtplxError(f"{stdlib}: no prompts could be built from the standard library")
    counts = {k: sum(p.kind == k for p in prompts) for k in KINDS}
    return prompts, f"default prompts from {', '.join(parts)}; kinds {counts}"


def prompts_from_samples(samples: Iterable[Sample]) -> list[Prompt]:
    """User data as prompts: chat samples without their final assistant turn, text as continuation prefixes."""
    out: list[Prompt] = []
    for i, s in enumerate(samples):
        key = f"{s.source}#{i}"
        if s.is_chat:
            turns = s.messages[:-1] if s.messages[-1][0] == "assistant" else s.messages
            if turns:
                out.append(Prompt("multi_turn" if len(turns) > 1 else "instruction", key, messages=turns))
        elif s.text.strip():
            out.append(Prompt("prose_continuation", key, text=s.text[: max(1, len(s.text) // 2)]))
    return out


def split_prompts(prompts: Sequence[Prompt], eval_fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """(train, eval) by a hash of each prompt's source: stable when prompts are added."""
    evals = [p for p in prompts if unit_hash("split:" + p.source) < eval_fraction]
    train = [p for p in prompts if unit_hash("split:" + p.source) >= eval_fraction]
    return train, evals


# ---------------------------------------------------------------- held-out check


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _line_hashes(text: str) -> set[str]:
    return {_sha(s) for line in text.splitlines() if len(s := line.strip()) >= _MIN_HELD_OUT_LINE}


def read_held_out(path: Path) -> list[Prompt]:
    """The prompts of a benchmark suite .jsonl: ``{"id", "kind", "prompt" | "messages"}`` per line
    (``source`` of each returned prompt = its id)."""
    out: list[Prompt] = []
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            if "messages" in row:
                turns = tuple((str(m["role"]), str(m["content"])) for m in row["messages"])
                out.append(Prompt(str(row["kind"]), str(row["id"]), messages=turns))
            else:
                out.append(Prompt(str(row["kind"]), str(row["id"]), text=str(row["prompt"])))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise MtplxError(f"{path}: unreadable held-out prompt suite ({err.__class__.__name__})") from None
    return out


def check_held_out(prompts: Sequence[Prompt], held_out: Sequence[Prompt]) -> dict[str, str | int]:
    """MtplxError naming the first training prompt that shares a whole text or a line with a held-out one.

    Returns a record for the manifest (how many prompts and lines were compared, by sha256).
    """
    whole = {_sha(h.all_text().strip()): h.source for h in held_out}
    lines: dict[str, str] = {}
    for h in held_out:
        lines.update({digest: h.source for digest in _line_hashes(h.all_text())})
    for p in prompts:
        text = p.all_text()
        hit = whole.get(_sha(text.strip())) or next(
            (lines[h] for h in _line_hashes(text) if h in lines), None
        )
        if hit is not None:
            raise MtplxError(f"{p.source}: training prompt overlaps held-out prompt {hit!r}")
    return {
        "held_out_prompts": len(held_out),
        "held_out_lines": len(lines),
        "training_prompts_checked": len(prompts),
        "method": f"sha256 of whole prompts and of stripped lines >= {_MIN_HELD_OUT_LINE} chars",
    }


def drop_held_out(prompts: Sequence[Prompt], held_out: Sequence[Prompt]) -> tuple[list[Prompt], int]:
    """The default set minus prompts ``check_held_out`` would refuse (a shared docstring line, say)."""
    kept = []
    for p in prompts:
        try:
            check_held_out([p], held_out)
        except MtplxError:
            continue
        kept.append(p)
    return kept, len(prompts) - len(kept)
