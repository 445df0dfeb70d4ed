"""Build benchmarks/prompts/suite.jsonl: the benchmark prompt suite, from text on this machine.

Four kinds, four prompts each, all held out from the default head's training data
(mtplx/forge/corpus.py: top-level stdlib ``*.py`` files, the Python docs' reST sources
split by file-name hash, Shakespeare's plays):

* code  (raw continuation): the lines before and including a function's ``def``
  and docstring, from standard-library *sub-package* files (json/, asyncio/,
  email/, concurrent/futures/): the forge corpus globs only the top level.
* prose (raw continuation): a paragraph and a half from doc pages in the forge's
  *eval* split (sha256("split:python-doc/<page>") < 0.08), cut mid-paragraph at a
  sentence end.
* chat  (chat template): questions about the topics of those eval-split pages;
  the FAQ ones are that page's own headings, verbatim.
* grounded (chat template): input-grounded requests whose answer copies from the
  prompt, where prompt lookup drafts: edit/refactor a whole function given in
  the message (the same held-out sub-package files), and summarise a passage
  quoting it (the prose passages above).

Run: ``.venv/bin/python benchmarks/prompts/build_suite.py`` (deterministic: same
sources, same file). Re-check the held-out claim against a head's manifest with
``--check models/<head>/manifest.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOC_DIR = Path("/usr/share/doc/python3.11/html/_sources")
STDLIB = Path(
    sysconfig.get_paths(vars={"base": sys.base_prefix, "installed_base": sys.base_prefix})["stdlib"]
)

# (id, stdlib file, function whose def + docstring end the prompt, lines of context before the def)
CODE = [
    ("code-json-decoder", "json/decoder.py", "py_scanstring", 12),
    ("code-asyncio-queues", "asyncio/queues.py", "put_nowait", 30),
    ("code-email-quoprimime", "email/quoprimime.py", "header_encode", 20),
    ("code-futures-thread", "concurrent/futures/thread.py", "_adjust_thread_count", 30),
]
# (id, doc page, section heading to start at, characters to take before cutting at a sentence end)
PROSE = [
    ("prose-unicode-definitions", "howto/unicode.rst.txt", "Definitions", 1400),
    ("prose-regex-intro", "howto/regex.rst.txt", "Introduction", 1400),
    ("prose-tutorial-errors", "tutorial/errors.rst.txt", "Exceptions", 1200),
    ("prose-tutorial-files", "tutorial/inputoutput.rst.txt", "Reading and Writing Files", 1200),
]
# (id, page the question is about, question)
CHAT = [
    ("chat-gui-toolkits", "faq/gui.rst.txt", "What GUI toolkits exist for Python?"),
    ("chat-tk-io", "faq/gui.rst.txt", "Can I have Tk events handled while waiting for I/O?"),
    (
        "chat-functools-partial",
        "library/functools.rst.txt",
        "What does functools.partial do in Python? Explain it and show a short example.",
    ),
    (
        "chat-unicode-bytes",
        "howto/unicode.rst.txt",
        "In Python 3, what is the difference between str and bytes, and how do I convert between them?",
    ),
]


# (id, stdlib file, function given whole, the request)
GROUNDED_CODE = [
    (
        "grounded-edit-json-encoder",
        "json/encoder.py",
        "py_encode_basestring_ascii",
        "Rename the parameter `s` to `text` everywhere in this function and return the complete "
        "updated function, nothing else.",
    ),
    (
        "grounded-refactor-futures-wait",
        "concurrent/futures/_base.py",
        "wait",
        "Refactor this function: add type hints to its signature and split the waiter set-up into a "
        "helper function. Return the complete refactored code.",
    ),
]
# (id, the prose prompt whose passage is given, the request)
GROUNDED_QUOTE = [
    (
        "grounded-quote-unicode",
        "prose-unicode-definitions",
        "Summarise this passage in a few sentences, quoting its key sentences verbatim.",
    ),
    (
        "grounded-quote-errors",
        "prose-tutorial-errors",
        "Summarise this passage in a few sentences, quoting its key sentences verbatim.",
    ),
]


def whole_function(path: Path, function: str) -> str:
    """The top-level function ``function`` of ``path``, from its def to its last body line."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"def {function}("))
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith((" ", "\t"))):
        end += 1
    while not lines[end - 1].strip():
        end -= 1
    return "\n".join(lines[start:end]) + "\n"


def code_prompt(path: Path, function: str, before: int) -> str:
    lines = path.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"\s*def {function}\(", line))
    end = start
    while not lines[end].rstrip().endswith(":"):  # multi-line signature
        end += 1
    body = lines[end + 1 :]
    stripped = body[0].strip() if body else ""
    if stripped.startswith(('"""', "'''")):
        quote = stripped[:3]
        close = (
            0
            if stripped.count(quote) >= 2
            else next(i for i, line in enumerate(body[1:], 1) if quote in line)
        )
        end += close + 1
    return "\n".join(lines[max(0, start - before) : end + 1]) + "\n"


def prose_prompt(path: Path, heading: str, chars: int) -> str:
    text = path.read_text(encoding="utf-8")
    match = re.search(rf"^{re.escape(heading)}\n[=\-~^*]+\n", text, re.M)
    if match is None:
        raise SystemExit(f"{path}: no section {heading!r}")
    section = text[match.end() :]
    section = re.sub(r"^\.\. [^\n]*\n(?:   [^\n]*\n)*", "", section, flags=re.M)  # reST directives
    section = re.sub(r"\n{3,}", "\n\n", section).strip()
    window = section[:chars]
    cut = max(window.rfind(". "), window.rfind(".\n"))
    return heading + "\n\n" + window[: cut + 1]


def build() -> list[dict]:
    rows = []
    for pid, rel, function, before in CODE:
        rows.append(
            {
                "id": pid,
                "kind": "code",
                "prompt": code_prompt(STDLIB / rel, function, before),
                "source": f"CPython {sys.version.split()[0]} Lib/{rel} ({function})",
            }
        )
    for pid, rel, heading, chars in PROSE:
        rows.append(
            {
                "id": pid,
                "kind": "prose",
                "prompt": prose_prompt(DOC_DIR / rel, heading, chars),
                "source": f"python3.11-doc {rel} ({heading})",
            }
        )
    passages = {row["id"]: (row["prompt"], row["source"]) for row in rows if row["kind"] == "prose"}
    for pid, rel, function, request in GROUNDED_CODE:
        code = whole_function(STDLIB / rel, function)
        rows.append(
            {
                "id": pid,
                "kind": "grounded",
                "messages": [{"role": "user", "content": f"{request}\n\n```python\n{code}```"}],
                "source": f"CPython {sys.version.split()[0]} Lib/{rel} ({function}, whole)",
            }
        )
    for pid, prose_id, request in GROUNDED_QUOTE:
        passage, source = passages[prose_id]
        rows.append(
            {
                "id": pid,
                "kind": "grounded",
                "messages": [{"role": "user", "content": f"{request}\n\n{passage}"}],
                "source": source,
            }
        )
    for pid, rel, question in CHAT:
        rows.append(
            {
                "id": pid,
                "kind": "chat",
                "messages": [{"role": "user", "content": question}],
                "source": f"python3.11-doc {rel} (topic)",
            }
        )
    return rows


def check(manifest: Path, rows: list[dict]) -> int:
    """Fail if any suite source file is among the files a head was trained on (data.train_files;
    its eval files are held out from training, so sharing them is fine)."""
    trained = set(json.loads(manifest.read_text(encoding="utf-8")).get("data", {}).get("train_files", []))
    clashes = []
    for row in rows:
        rel = (
            row["source"].split("Lib/")[1].split()[0] if "Lib/" in row["source"] else row["source"].split()[1]
        )
        if {f"python-doc/{rel}", f"stdlib/{rel}"} & trained:
            clashes.append(f"{row['id']}: {rel}")
    for clash in clashes:
        print(f"held-out violation: {clash}")
    if not clashes:
        print(
            f"held out: none of the {len(rows)} prompts' sources is among the {len(trained)} training files"
        )
    return 1 if clashes else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "suite.jsonl"))
    parser.add_argument(
        "--check", default=None, metavar="MANIFEST", help="check the sources against a head manifest"
    )
    args = parser.parse_args()
    rows = build()
    if args.check:
        return check(Path(args.check), rows)
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(out)
    print(f"wrote {len(rows)} prompts to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
