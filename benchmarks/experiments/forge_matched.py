"""Matched prompts (issue 28, item 1b): at equal data size, does a head fine-tuned on prompts built
per benchmark-suite kind from offline sources draft the held-out suite better than one fine-tuned
on forge's own default prompt mix?

Arms (each its own ``--out``; shards are forge's, made by `mtplx.forge.record.generate_shards`):

* ``matched``: prompts in the *form* of the suite's four kinds, never its text (the suite stays
  held out: `check_held_out` by sha256 of whole prompts and lines, plus a shared-word-run check,
  both recorded): ``code``, raw continuations of windows of CPython standard-library
  sub-package sources cut mid-line (packages the suite draws from are left out); ``prose``, raw
  continuations of passages (a title, then paragraphs, cut mid-sentence) of the Python language
  reference shipped with CPython and of Debian documentation under /usr/share/doc; ``grounded``,
  code edits on a given function (rename an argument, add hints / a docstring, split out a helper)
  and summarize-with-exact-quotes requests on a given passage; ``chat``, short questions about
  standard-library names and language topics. Equal numbers per kind.
* ``mix``: forge's default prompts (`mtplx.forge.prompts.default_prompts`, held-out overlaps
  dropped as `mtplx forge` drops them).
* ``half``: no generation of its own; half its tokens from ``matched``'s shards, half from ``mix``'s.

Both generating arms use the same settings: batch 32, shards alternating greedy and t 0.7 /
top-p 0.95 (shard 0 greedy), top-32 log-probs, ``--seq-len`` / ``--max-prompt`` for both. Training
trims every arm to the same ``--train-tokens`` response tokens (whole rows, seeded choice) and runs
`forge_ceiling.train_and_score` (the shipped recipe from the shipped head), scored on the suite's
greedy text ("suite d1", by item 1c the first-draft acceptance of real greedy decoding).

    nice -n 19 .venv/bin/python benchmarks/experiments/forge_matched.py --arm matched --stage gen --gen-tokens 7000
    nice -n 19 .venv/bin/python benchmarks/experiments/forge_matched.py --arm mix --stage gen --gen-tokens 7000
    nice -n 19 .venv/bin/python benchmarks/experiments/forge_matched.py --arm matched --stage train --train-tokens 6500
    nice -n 19 .venv/bin/python benchmarks/experiments/forge_matched.py --report-only --plot benchmarks/results/forge-matched.png
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import re
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # forge_ceiling, forge_ablation, beside this script

import mtplx  # noqa: E402, F401  (optimized BLAS before mlx)
from mtplx.forge.config import DEFAULT_FORGE_CONFIG  # noqa: E402
from mtplx.forge.corpus import split_passages, stdlib_dir, unit_hash  # noqa: E402
from mtplx.forge.prompts import (  # noqa: E402
    DEBIAN_DOC_DIR,
    Prompt,
    check_held_out,
    default_prompts,
    drop_held_out,
    read_held_out,
)
from mtplx.forge.record import SHARD_FILES, ForgeData, ShardPlan, generate_shards, load_shards  # noqa: E402
from mtplx.io import atomic_path  # noqa: E402

import forge_ablation  # noqa: E402
import forge_ceiling  # noqa: E402
import numpy as np  # noqa: E402

ARMS = ("matched", "mix", "half")
SUITE_KINDS = ("chat", "code", "grounded", "prose")
# Packages the suite's code and grounded prompts come from (json, asyncio, email, concurrent.futures):
# never read, so no window of those files can be trained on.
SUITE_PACKAGES = {"json", "asyncio", "email", "concurrent"}
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "pydoc_data"}
RUN_WORDS = 8  # a prompt sharing a run of this many words with a suite prompt is dropped

# ---------------------------------------------------------------- matched prompts

_EDITS = (
    "In the function below, change the name of the argument `{a}` to `{new}` wherever it appears. "
    "Reply with the full function only.\n\n```python\n{body}\n```",
    "Give this function type annotations and move one self-contained step of it into a helper "
    "function. Show all of the resulting code.\n\n```python\n{body}\n```",
    "Add a docstring and type hints to this function without changing its behaviour, and reply with "
    "the whole function.\n\n```python\n{body}\n```",
    "Replace `{a}` by `{new}` throughout this code; keep everything else as it is and return it "
    "complete.\n\n```python\n{body}\n```",
)
_QUOTES = (
    "Give a short summary of the text below and quote, word for word, the sentences that carry its "
    "main points.\n\n{t}",
    "In a few sentences, say what this passage explains; include its most important sentences as "
    "exact quotes.\n\n{t}",
    "What does this section say? Answer briefly and cite its central sentences exactly as written.\n\n{t}",
)
_NAME_QUESTIONS = (
    "How do I use {q} in Python? A brief explanation with a small example, please.",
    "What is {q} for, and how would I call it?",
    "Could you explain what {q} does and when I would reach for it?",
    "What does {q} return, and is there anything to watch out for when using it?",
)
_PAIR_QUESTIONS = ("In the {m} module, what is the difference between {a} and {b}?",)
_TOPIC_QUESTIONS = (
    "How does {t} work in Python?",
    "Can you explain {t} in Python with a short example?",
    "What should a beginner know about {t} in Python?",
)
_NEW_NAMES = ("value", "data", "item", "source", "target", "result_list", "name_map", "options")


def _pick(options, key: str):
    return options[int(unit_hash("m:" + key) * len(options))]


def _sub_package_files(stdlib: Path) -> list[Path]:
    """Standard-library .py files inside packages (not the top level forge's default set reads),
    minus tests and the packages the suite's code comes from."""
    out = []
    for f in sorted(stdlib.rglob("*.py")):
        parts = f.relative_to(stdlib).parts
        if len(parts) < 2 or parts[0] in SUITE_PACKAGES or SKIP_DIRS & set(parts):
            continue
        out.append(f)
    return out


def _code_windows(path: Path, label: str, lines: list[str]) -> list[Prompt]:
    """Up to two raw continuation windows of a source file, 450-850 characters cut in mid-line (so that
    they fit ``--max-prompt`` tokens)."""
    out = []
    for w in range(2):
        key = f"{label}#{w}"
        if len(lines) < 40:
            break
        start = int(unit_hash("start:" + key) * (len(lines) - 30))
        target = 450 + int(unit_hash("len:" + key) * 400)
        text, i = "", start
        while i < len(lines) and len(text) < target:
            text += lines[i] + "\n"
            i += 1
        last = lines[i - 1]
        if len(last.strip()) < 8 or sum(bool(s.strip()) for s in text.splitlines()) < 8:
            continue
        cut = len(text) - len(last) - 1 + 4 + int(unit_hash("cut:" + key) * (len(last) - 6))
        out.append(Prompt("code", key, text=text[:cut]))
    return out


def _functions(tree: ast.AST, lines: list[str], label: str) -> list[tuple[str, str, list[str]]]:
    """(key, source, argument names) of functions 6-22 lines and at most 800 characters long."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
            n = node.end_lineno - node.lineno + 1
            body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            if 6 <= n <= 22 and len(body) <= 800:
                args = [a.arg for a in node.args.args if a.arg not in ("self", "cls") and len(a.arg) > 1]
                out.append((f"{label}:{node.name}:{node.lineno}", textwrap.dedent(body), args))
    return out


def _code_sources(stdlib: Path) -> tuple[list[Prompt], list[Prompt], list[Prompt]]:
    """(code continuations, code edits, questions about names) from the sub-package sources."""
    code, edits, questions = [], [], []
    for f in _sub_package_files(stdlib):
        try:
            source = f.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        label = f"stdlib/{f.relative_to(stdlib)}"
        lines = source.splitlines()
        code.extend(_code_windows(f, label, lines))
        for key, body, args in _functions(tree, lines, label):
            if unit_hash("edit:" + key) < 0.15:
                template = _pick(_EDITS, key)
                if "{a}" in template and not args:
                    continue
                a = _pick(args, "arg:" + key) if args else ""
                new = next(n for n in _NEW_NAMES[int(unit_hash("new:" + key) * 8) :] + _NEW_NAMES if n != a)
                edits.append(
                    Prompt("grounded", key, messages=(("user", template.format(a=a, new=new, body=body)),))
                )
        module = ".".join(f.relative_to(stdlib).with_suffix("").parts).removesuffix(".__init__")
        public = [
            n.name
            for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.ClassDef)
            and not n.name.startswith("_")
            and ast.get_docstring(n)
        ]
        for name in public[:3]:
            key = f"{label}:{name}:q"
            q = _pick(_NAME_QUESTIONS, key).format(q=f"{module}.{name}")
            questions.append(Prompt("chat", key, messages=(("user", q),)))
        if len(public) >= 2:
            key = f"{label}:pair"
            q = _pick(_PAIR_QUESTIONS, key).format(m=module, a=public[0], b=public[1])
            questions.append(Prompt("chat", key, messages=(("user", q),)))
    return code, edits, questions


def _read_doc(f: Path) -> str | None:
    try:
        raw = gzip.decompress(f.read_bytes()) if f.suffix == ".gz" else f.read_bytes()
        return raw.decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None


def _documents(stdlib: Path, doc_root: Path) -> list[tuple[str, str]]:
    """(label, text) of the language reference's topics and Debian's README / text documentation."""
    docs = []
    path = stdlib / "pydoc_data" / "topics.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    topics = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign))
    docs.extend((f"pydoc-topics/{k}", str(v)) for k, v in sorted(topics.items()))
    names = re.compile(r"(README[^/]*|[^/]*\.(md|txt|rst))(\.gz)?$", re.IGNORECASE)
    per_package: dict[str, int] = {}
    for f in sorted(doc_root.rglob("*")):
        package = f.relative_to(doc_root).parts[0]
        if per_package.get(package, 0) >= 2:  # at most two files a package (git alone ships hundreds)
            continue
        if f.is_file() and names.search(f.name) and "changelog" not in f.name.lower():
            text = _read_doc(f)
            if text and len(text) > 800:
                docs.append((f"debian-doc/{f.relative_to(doc_root)}", text))
                per_package[package] = per_package.get(package, 0) + 1
    return docs


def _passages(text: str) -> list[str]:
    """Passages of 600-1100 characters that read as prose (few symbols, several sentences)."""
    out = []
    for p in split_passages(text, max_chars=1000):
        letters = sum(c.isalpha() or c.isspace() for c in p)
        if 600 <= len(p) <= 1100 and letters > 0.85 * len(p) and p.count(". ") >= 3:
            out.append(p)
    return out


def _doc_prompts(stdlib: Path, doc_root: Path) -> tuple[list[Prompt], list[Prompt], list[Prompt]]:
    """(prose continuations, summarize-and-quote requests, topic questions)."""
    prose, quotes, topics = [], [], []
    for label, text in _documents(stdlib, doc_root):
        if label.startswith("pydoc-topics/"):
            key = label + ":q"
            topic = label.split("/", 1)[1].replace("-", " ")
            q = _pick(_TOPIC_QUESTIONS, key).format(t=f"'{topic}'")
            topics.append(Prompt("chat", key, messages=(("user", q),)))
        for i, p in enumerate(_passages(text)[:3]):
            key = f"{label}#{i}"
            if unit_hash("doc:" + key) < 0.6:
                cut = int(len(p) * (0.7 + 0.2 * unit_hash("cut:" + key)))
                prose.append(Prompt("prose", key, text=p[:cut]))
            else:
                ask = _pick(_QUOTES, key).format(t=p)
                quotes.append(Prompt("grounded", key, messages=(("user", ask),)))
    return prose, quotes, topics


def _word_runs(text: str, n: int = RUN_WORDS) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def matched_prompts(
    per_kind: int = 240, stdlib: Path | None = None, doc_root: Path = DEBIAN_DOC_DIR
) -> tuple[list[Prompt], dict]:
    """``per_kind`` prompts of each suite kind (seeded choice), and a record of sources and counts."""
    stdlib = stdlib or stdlib_dir()
    code, edits, name_qs = _code_sources(stdlib)
    prose, quotes, topic_qs = _doc_prompts(stdlib, doc_root)
    pools = {
        "code": code,
        "prose": prose,
        # grounded: half code edits, half passages to summarize with quotes; chat: names, then topics
        "grounded": _take(edits, per_kind // 2) + _take(quotes, per_kind - min(len(edits), per_kind // 2)),
        "chat": _take(topic_qs, per_kind // 3) + _take(name_qs, per_kind - min(len(topic_qs), per_kind // 3)),
    }
    prompts = [p for kind in SUITE_KINDS for p in _take(pools[kind], per_kind)]
    record = {
        "sources": {
            "code": f"{stdlib} sub-package .py files minus {sorted(SUITE_PACKAGES)} and tests",
            "prose": f"{stdlib}/pydoc_data/topics.py and {doc_root} README / .md / .txt / .rst (also .gz)",
            "grounded": "functions of those sources (edits), passages of those docs (quotes)",
            "chat": "language-reference topic names and public names of those sources",
        },
        "pool_sizes": {
            "code": len(code),
            "prose": len(prose),
            "edits": len(edits),
            "quotes": len(quotes),
            "name_questions": len(name_qs),
            "topic_questions": len(topic_qs),
        },
    }
    return prompts, record


def _take(pool: list[Prompt], n: int) -> list[Prompt]:
    return sorted(pool, key=lambda p: unit_hash("take:" + p.source))[:n]


def held_out_checked(prompts: list[Prompt]) -> tuple[list[Prompt], dict]:
    """The prompts minus any sharing a line (forge's check) or a run of RUN_WORDS words with a suite
    prompt; then `check_held_out` must pass. Returns the kept prompts and the record of the check."""
    suite = read_held_out(forge_ablation.SUITE)
    kept, dropped_lines = drop_held_out(prompts, suite)
    runs = set().union(*(_word_runs(s.all_text()) for s in suite))
    shared = [p for p in kept if _word_runs(p.all_text()) & runs]
    kept = [p for p in kept if not (_word_runs(p.all_text()) & runs)]
    record = check_held_out(kept, suite)  # raises on any overlap left
    record.update(
        dropped_sharing_a_line=dropped_lines,
        dropped_sharing_a_word_run=len(shared),
        word_run=RUN_WORDS,
        dropped_sources=[p.source for p in shared][:20],
    )
    return kept, record


# ---------------------------------------------------------------- generation and training


def arm_prompts(arm: str, per_kind: int) -> tuple[list[Prompt], dict]:
    if arm == "matched":
        prompts, record = matched_prompts(per_kind)
    else:
        prompts, desc = default_prompts()
        record = {"description": desc}
    prompts, check = held_out_checked(prompts)
    kinds = {k: sum(p.kind == k for p in prompts) for k in sorted({p.kind for p in prompts})}
    return prompts, {**record, "prompts": len(prompts), "kinds": kinds, "held_out_check": check}


def take_tokens(data: ForgeData, limit: int, seed: int) -> np.ndarray:
    """Whole rows in a seeded order, as many as fit in ``limit`` response tokens: their indices, in order."""
    per_row = data.valid.sum(axis=1)
    order = np.random.default_rng([seed, 28]).permutation(data.num_sequences)
    return np.sort(order[np.cumsum(per_row[order]) <= limit])


def arm_data(arm: str, root: Path, limit: int, seed: int) -> tuple[ForgeData, dict]:
    """The arm's training rows, trimmed to ``limit`` response tokens, and what they hold."""
    parts = {"half": (("matched", limit // 2), ("mix", limit - limit // 2))}.get(arm, ((arm, limit),))
    datas, described = [], {}
    for source, n in parts:
        data, metas = load_shards(root / f"matched-{source}" / "train")
        rows = take_tokens(data, n, seed)
        kept = ForgeData(*(getattr(data, f)[rows] for f in SHARD_FILES))
        datas.append(kept)
        kinds = np.array([k for m in metas for k in m["kinds"]])[rows]
        settings = np.array([m["setting"] for m in metas for _ in m["kinds"]])[rows]
        described[source] = {
            "shards": len(metas),
            "generated_sequences": data.num_sequences,
            "generated_response_tokens": data.num_response_tokens,
            "kept_sequences": kept.num_sequences,
            "kept_response_tokens": kept.num_response_tokens,
            "kept_by_kind": {str(k): int((kinds == k).sum()) for k in sorted(set(kinds))},
            "kept_by_setting": {str(k): int((settings == k).sum()) for k in sorted(set(settings))},
            "kept_tokens_by_kind": {str(k): int(kept.valid[kinds == k].sum()) for k in sorted(set(kinds))},
            "generation_seconds": round(sum(m["seconds"] for m in metas), 1),
        }
    return ForgeData.concat(datas), described


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", choices=ARMS, default="matched")
    ap.add_argument("--root", type=Path, default=Path("/tmp"), help="arms live in ROOT/matched-<arm>")
    ap.add_argument("--stage", choices=("prompts", "gen", "train"), default="prompts")
    ap.add_argument("--per-kind", type=int, default=240, help="matched prompts of each suite kind")
    ap.add_argument("--gen-tokens", type=int, default=7000, help="response tokens to generate")
    ap.add_argument("--shards", type=int, default=2, help="at most this many shards (0 greedy, 1 t 0.7, ...)")
    ap.add_argument("--seq-len", type=int, default=448)
    ap.add_argument("--max-prompt", type=int, default=320)
    ap.add_argument("--train-tokens", type=int, default=6500, help="response tokens every arm trains on")
    ap.add_argument("--init-head", default="models/smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--until", type=int, default=None, help="stop after this step's point (resumable)")
    ap.add_argument("--suite-tokens", type=int, default=64)
    ap.add_argument(
        "--suite-cache", type=Path, default=None, help="suite greedy text (forge_ceiling's cache)"
    )
    ap.add_argument("--origins", type=int, default=DEFAULT_FORGE_CONFIG.eval_origins)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--json", type=Path, default=None, help="default benchmarks/results/forge-matched-<arm>.json"
    )
    ap.add_argument("--report-only", action="store_true", help="table (and --plot) of every arm's JSON")
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()
    results = Path(__file__).resolve().parents[1] / "results"
    if args.report_only:
        reports = {
            a: json.loads(p.read_text()) for a in ARMS if (p := results / f"forge-matched-{a}.json").is_file()
        }
        print(markdown_table(reports))
        if args.plot:
            plot(reports, args.plot)
        return
    out = args.root / f"matched-{args.arm}"
    args.json = args.json or results / f"forge-matched-{args.arm}.json"
    report = json.loads(args.json.read_text()) if args.json.is_file() else {}
    if args.stage == "prompts" or (args.stage == "gen" and args.arm != "half"):
        if args.arm == "half":
            raise SystemExit("--arm half has no prompts of its own (it trains on matched's and mix's shards)")
        prompts, record = arm_prompts(args.arm, args.per_kind)
        report["prompts"] = record
        if args.stage == "prompts":
            print(json.dumps(record, indent=1))
            for kind in sorted({p.kind for p in prompts}):
                example = next(p for p in prompts if p.kind == kind)
                print(f"--- {kind} ({example.source}):\n{example.all_text()[:600]}\n")
            return
        from mtplx.engine.engine import Engine

        engine = Engine.load()
        plan = ShardPlan(
            tuple(prompts),
            (forge_ceiling.GREEDY, forge_ceiling.SAMPLED),
            DEFAULT_FORGE_CONFIG.gen_batch,
            args.seq_len,
            DEFAULT_FORGE_CONFIG.top_n,
            args.seed,
            engine.fingerprint,
        )
        report["generation"] = generate_shards(
            engine,
            plan,
            out / "train",
            args.gen_tokens,
            None,
            True,
            f"gen {args.arm}",
            args.max_prompt,
            args.shards,
        )
        report["generation"].update(seq_len=args.seq_len, max_prompt=args.max_prompt, batch=plan.batch)
        forge_ceiling.write(args.json, report)
        return
    from mtplx.engine.engine import Engine

    engine = Engine.load()
    data, described = arm_data(args.arm, args.root, args.train_tokens, args.seed)
    report["data"] = described
    cache = args.suite_cache or out / f"suite-greedy-{args.suite_tokens}.json"
    ckpt_dir = out / f"ckpt-lr{args.lr:g}-{args.steps}-{args.train_tokens}"
    extra = {"arm": args.arm, "train_tokens_limit": args.train_tokens}
    report = forge_ceiling.train_and_score(engine, data, None, cache, ckpt_dir, args, report, extra)
    forge_ceiling.write(args.json, report)
    print(markdown_table({args.arm: report}))


def markdown_table(reports: dict[str, dict]) -> str:
    """Arm x step: suite d1 t 0 / t 0.7, and by kind (t 0 / t 0.7)."""
    lines = [
        "| arm | step (tokens, epochs) | suite d1 t0 / t0.7 | " + " | ".join(SUITE_KINDS) + " |",
        "|---" * (3 + len(SUITE_KINDS)) + "|",
    ]
    for arm, report in reports.items():
        for p in report.get("points", []):
            kinds = p["suite_depth1_by_kind"]
            cells = [f"{p['suite_depth1']['0.0']:.3f} / {p['suite_depth1']['0.7']:.3f}"]
            cells += [f"{kinds[k]['0.0']:.2f} / {kinds[k]['0.7']:.2f}" for k in SUITE_KINDS]
            lines.append(
                f"| {arm} | {p['step']} ({p['tokens'] / 1e3:.1f}k, {p['epochs']}) | "
                + " | ".join(cells)
                + " |"
            )
    return "\n".join(lines)


def plot(reports: dict[str, dict], path: Path) -> None:
    """Suite d1 against steps, one colour per arm, t 0 solid and t 0.7 dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for i, (arm, report) in enumerate(reports.items()):
        points = report.get("points", [])
        steps = [p["step"] for p in points]
        for t, style in (("0.0", "-o"), ("0.7", "--s")):
            ax.plot(
                steps, [p["suite_depth1"][t] for p in points], style, color=f"C{i}", label=f"{arm}, t {t}"
            )
    ax.set_xlabel("training steps (8 sequences each), from the shipped head")
    ax.set_ylabel("suite d1 (teacher-forced first-draft acceptance)")
    ax.set_title("matched prompts vs forge's prompt mix, equal response tokens (issue 28, 1b)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)


if __name__ == "__main__":
    main()
