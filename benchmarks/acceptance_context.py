"""Acceptance where it decays (issue 28, item 4): first-draft acceptance against the position in
the context up to 4k tokens, and the adaptive head-length gate against the best fixed depths.

Three stages, each writing its part of one JSON document (``--stages``, rerun one alone):

* ``human``: teacher-forced first-draft acceptance at every position of long human texts,
  the first ``--max-context`` tokens of each document below (raw text) and of each long chat as
  the ``contexts`` stage built it (its pasted sections, questions and the trunk's answers through
  the chat template), greedy (argmax agreement) and t 0.7 (1 - TV(p, q)), by position bin.
  This is the head on text the trunk did not write: a different quantity from decoding.
* ``contexts``: real decoding at growing context. Each document is cut at ``--lengths`` tokens
  and continued for ``--tokens`` tokens through `Engine.generate` (EOS banned, as `mtplx bench`
  bans it), greedy and t 0.7 (top-p 1, so the trunk's p is its softmax at 0.7 in both
  measures). Each chat is a conversation that pastes the next section of a document every turn
  with a question; the trunk's greedy answer is appended and the next turn asks again, until the
  prompt reaches ``--max-context`` minus the answer. Every cycle's first draft is read from the
  loop's own `Step`s (`forge_decode_check.StepRecorder`): kept (greedy) or min(1, p/q) (t 0.7),
  at its position. Where the prompt holds at least ``--long-from`` tokens, every variant runs
  as one block (mtplx AR, head depth 1, 2, 3, adaptive up to 3 at ``--threshold``), in an
  order rotated per block, so speed ratios are paired. The first ``--spot-check`` documents'
  longest greedy decodes are also scored teacher-forced at the cycles' positions
  (`forge_decode_check.teacher_forced_all`): item 1c's check at long context.
* ``suite``: the same variants on the benchmark suite's prompts (short context), one block
  per (prompt, setting).
* ``costs`` (optional): a verify forward of 1-4 tokens and one head step timed apart at a short
  and a long context (fastest of interleaved tries). The summary turns each variant's tokens and
  drafts per cycle into a modelled speed over AR with these costs, or without them with the
  profiler's short-context costs (RESULTS.md "Where the time goes"): a load-independent check
  on the paired tokens/s ratios.

Sources (offline, held out from the shipped head's forge data: forge reads CPython's top-level
``Lib/*.py`` and Debian's uncompressed README / .md / .txt files): CPython sub-package modules,
Debian's compressed manuals, a reST manual and a sub-package module pasted into the chats.

    nice -n 19 .venv/bin/python benchmarks/acceptance_context.py --stages contexts,suite,human \\
        --json benchmarks/results/acceptance-context.json --plot benchmarks/results/acceptance-context.png

``--report`` re-summarizes and re-plots a saved JSON without running anything. Acceptance and
tokens per cycle do not depend on the machine's load; the tokens/s ratios do (paired per block).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.bench.report import provenance, write_json
from mtplx.bench.runners import ban_bias
from mtplx.bench.suite import load_prompts
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.forge.corpus import split_passages, stdlib_dir
from mtplx.io import atomic_path
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.drafting import DEFAULT_ADAPTIVE_THRESHOLD
from mtplx.spec_decode.settings import Drafting
from mtplx.trunk import rollback

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # forge_decode_check, beside this script
from forge_decode_check import StepRecorder, cycles_of, teacher_forced_all  # noqa: E402

STDLIB = stdlib_dir()
DOC = Path("/usr/share/doc")
# (id, kind, file, the line the text starts at (None: the file's start))
DOCUMENTS = [
    ("code-logging", "code", STDLIB / "logging" / "__init__.py", None),
    ("code-http-client", "code", STDLIB / "http" / "client.py", None),
    ("prose-libpng-manual", "prose", DOC / "libpng16-16" / "libpng-manual.txt.gz", "I. Introduction"),
    ("prose-slang-guide", "prose", DOC / "libslang2" / "slang.txt.gz", None),
]
# (id, kind of what is pasted, file, what the user calls it, the questions asked in turn)
CHATS = [
    (
        "chat-pkg-resources",
        "prose",
        DOC / "python3-pkg-resources" / "pkg_resources.rst.gz",
        "the pkg_resources documentation",
        (
            "Summarize this part in two or three sentences.",
            "What should a Python developer take away from this part?",
            "Explain this part to someone new to Python packaging.",
        ),
    ),
    (
        "chat-minidom",
        "code",
        STDLIB / "xml" / "dom" / "minidom.py",
        "the source of xml/dom/minidom.py",
        (
            "Explain what this code does.",
            "What could go wrong in this code, and how would you test it?",
            "Summarize this code in two or three sentences.",
        ),
    ),
]
SECTION_CHARS = 1400  # about 350 tokens pasted per chat turn
SETTINGS = {"greedy": 0.0, "t0.7": 0.7}
BINS = (0, 256, 512, 1024, 2048, 3072, 4096)
PLOT_BIN = 256


def variants(threshold: float) -> dict[str, tuple[str, int | None, float | None]]:
    """name: (drafter kind, depth, adaptive threshold)."""
    return {
        "ar": ("none", None, None),
        "d1": ("head", 1, None),
        "d2": ("head", 2, None),
        "d3": ("head", 3, None),
        f"adaptive-d3-{threshold:g}": ("head", 3, threshold),
    }


def chosen_source(args, source: str) -> bool:
    return not args.sources or source in args.sources.split(",")


def read_text(path: Path, start: str | None = None) -> str:
    raw = gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")
    with raw as f:
        text = f.read()
    if start is not None:
        lines = text.split("\n")
        text = "\n".join(lines[lines.index(start) :])
    return text


# ------------------------------------------------------------------------------------- one decode


def decode(engine: Engine, prompt, chat: bool, variant: tuple, temperature: float, tokens: int, seed: int):
    """One `Engine.generate` (EOS banned), its first drafts per cycle and its counts."""
    kind, depth, threshold = variant
    request = GenerationRequest(
        sampler=SamplerConfig(temperature=temperature, top_p=1.0, logit_bias=ban_bias(engine.tokenizer)),
        max_tokens=tokens,
        seed=seed,
        chat=chat,
        drafting=Drafting(
            kind=kind, depth=depth, adaptive=threshold is not None, adaptive_threshold=threshold
        ),
    )
    prompt_len = len(engine.encode_prompt(prompt, chat=chat))
    with StepRecorder() as rec:
        result = engine.generate(prompt, request)
    stats = result.stats
    cycles = cycles_of(rec.steps, prompt_len, len(result.token_ids)) if kind != "none" else []
    drafted = sum(s.num_drafted for s in rec.steps)
    row = {
        "prompt_tokens": prompt_len,
        "generated": len(result.token_ids),
        "decode_seconds": stats.decode_seconds,
        "decode_tokens_per_sec": stats.decode_tokens_per_sec,
        "cycles": stats.cycles,
        "tokens_per_cycle": stats.tokens_per_cycle,
        "drafts_per_cycle": drafted / max(stats.cycles, 1) if kind != "none" else 0.0,
        "first_drafts": [[c["position"] + 1, int(c["kept"]), round(c["accept_prob"], 4)] for c in cycles],
    }
    return result, row


def run_block(engine, prompt, chat, names, all_variants, temperature, tokens, seed, rotate) -> dict:
    """Every variant in ``names`` once on one prompt, in an order rotated by ``rotate``."""
    order = names[rotate % len(names) :] + names[: rotate % len(names)]
    out = {}
    for name in order:
        result, row = decode(engine, prompt, chat, all_variants[name], temperature, tokens, seed)
        row["order"] = order.index(name)
        out[name] = (result, row)
    return {name: out[name] for name in names}


# ----------------------------------------------------------------------------------- the stages


def stage_contexts(engine: Engine, args, report: dict, save) -> None:
    all_variants = variants(args.threshold)
    names = list(all_variants)
    runs = report.setdefault("contexts", [])
    done = {(r["source"], r["prompt_tokens"], r["setting"]) for r in runs}
    chats = report.setdefault("chat_transcripts", {})
    block = len({(r["source"], r["prompt_tokens"]) for r in runs})

    def measure(source, kind, prompt, chat, length, spot: bool) -> str | None:
        nonlocal block
        greedy_text = None
        long = length >= args.long_from
        for setting, temperature in SETTINGS.items():
            if (source, length, setting) in done:  # resumed: the greedy answer is in its row
                greedy_text = next(
                    (
                        r.get("text")
                        for r in runs
                        if (r["source"], r["prompt_tokens"], r["setting"], r["variant"])
                        == (source, length, "greedy", "d1")
                    ),
                    greedy_text,
                )
                continue
            chosen = names if long else ["d1"]
            rows = run_block(
                engine, prompt, chat, chosen, all_variants, temperature, args.tokens, args.seed, block
            )
            for name, (result, row) in rows.items():
                row.update(source=source, kind=kind, setting=setting, variant=name)
                if setting == "greedy" and name == "d1":
                    greedy_text = row["text"] = result.text
                    if spot:
                        row["spot_check"] = spot_check(engine, prompt, chat, result, row)
                runs.append(row)
            block += 1
            save()
            d1 = rows["d1"][1]
            print(
                f"{source} L={length} {setting}: d1 first-draft {first_draft_mean(d1, temperature):.3f} "
                f"tau {d1['tokens_per_cycle']:.2f}"
                + ("".join(f" | {n} {r['decode_tokens_per_sec']:.1f} tok/s" for n, (_, r) in rows.items())),
                file=sys.stderr,
                flush=True,
            )
        return greedy_text

    documents = [d for d in DOCUMENTS if chosen_source(args, d[0])]
    for i, (source, kind, path, start) in enumerate(documents):
        ids = engine.encode_prompt(read_text(path, start), chat=False)
        for length in args.lengths:
            measure(
                source,
                kind,
                ids[:length],
                False,
                length,
                spot=i < args.spot_check and length == max(args.lengths),
            )
    for source, kind, path, label, questions in [c for c in CHATS if chosen_source(args, c[0])]:
        sections = split_passages(read_text(path), max_chars=SECTION_CHARS)
        messages = chats.get(source) or []
        turn = len(messages) // 2
        # Resume: earlier turns' answers are in the transcript; each turn is measured once.
        while turn < len(sections):
            intro = f"I am reading {label}. I will paste it part by part. " if turn == 0 else ""
            user = f"{intro}Here is the next part:\n\n{sections[turn]}\n\n{questions[turn % len(questions)]}"
            ask = [*messages, {"role": "user", "content": user}]
            length = len(engine.encode_prompt(ask, chat=True))
            if length + args.tokens > args.max_context:
                break
            answer = measure(source, f"chat-{kind}", ask, True, length, spot=False)
            messages = [*ask, {"role": "assistant", "content": answer}]
            chats[source] = messages
            turn += 1
            save()


def spot_check(engine, prompt, chat, result, row) -> dict:
    """Item 1c at long context: the decode's first drafts against teacher-forced at their positions."""
    window = engine.encode_prompt(prompt, chat=chat) + list(result.token_ids)
    positions = [p - 1 for p, _, _ in row["first_drafts"]]
    tf = teacher_forced_all(engine, window, (0.0,))[0.0][positions]
    kept = np.array([k for _, k, _ in row["first_drafts"]], dtype=float)
    return {
        "cycles": len(positions),
        "decode_first": float(kept.mean()),
        "teacher_forced_same_positions": float(tf.mean()),
        "differing_positions": int(np.sum(kept != tf)),
    }


def stage_suite(engine: Engine, args, report: dict, save) -> None:
    all_variants = variants(args.threshold)
    names = list(all_variants)
    runs = report.setdefault("suite", [])
    done = {(r["source"], r["setting"]) for r in runs}
    prompts = load_prompts(per_kind=args.suite_per_kind)
    for i, p in enumerate(prompts):
        for j, (setting, temperature) in enumerate(SETTINGS.items()):
            if (p.id, setting) in done:
                continue
            rows = run_block(
                engine,
                p.engine_input,
                p.is_chat,
                names,
                all_variants,
                temperature,
                args.tokens,
                args.seed,
                2 * i + j,
            )
            for name, (_, row) in rows.items():
                row.update(source=p.id, kind=p.kind, setting=setting, variant=name)
                runs.append(row)
            save()
            print(
                f"suite {p.id} {setting}:"
                + "".join(
                    f" | {n} tau {r['tokens_per_cycle']:.2f} {r['decode_tokens_per_sec']:.1f} tok/s"
                    for n, (_, r) in rows.items()
                ),
                file=sys.stderr,
                flush=True,
            )


def stage_human(engine: Engine, args, report: dict, save) -> None:
    """Teacher-forced acceptance at every position of the first ``max_context`` tokens of each text."""
    texts = report.setdefault("human", {})
    windows = []
    for source, kind, path, start in [d for d in DOCUMENTS if chosen_source(args, d[0])]:
        windows.append((source, kind, engine.encode_prompt(read_text(path, start), chat=False)))
    for source, kind, *_ in [c for c in CHATS if chosen_source(args, c[0])]:
        messages = report.get("chat_transcripts", {}).get(source)
        if messages:
            windows.append((source, f"chat-{kind}", engine.encode_prompt(messages, chat=True)))
    for source, kind, ids in windows:
        if source in texts:
            continue
        window = ids[: args.max_context]
        tf = teacher_forced_all(engine, window, tuple(SETTINGS.values()))
        texts[source] = {
            "kind": kind,
            "tokens": len(window),
            # Entry j: the draft of token j + 2, so j + 2 tokens before it (the trunk scores it at j + 1).
            "first_context": 2,
            **{s: [round(float(x), 4) for x in tf[t][1:]] for s, t in SETTINGS.items()},
        }
        save()
        print(
            f"human {source}: {len(window)} tokens, greedy {np.nanmean(tf[0.0]):.3f} t0.7 {np.nanmean(tf[0.7]):.3f}",
            file=sys.stderr,
            flush=True,
        )


def stage_costs(engine: Engine, args, report: dict, save) -> None:
    """What a cycle's parts cost at a short and a long context, timed apart: the trunk forward of
    1-4 tokens (a verify of 0-3 drafts; 1 token is an AR step) and one head draft step, each the
    fastest of ``--cost-reps`` interleaved tries (the minimum is the least load-dependent figure)."""
    head, trunk = engine.head, engine.trunk
    ids = engine.encode_prompt(read_text(DOCUMENTS[0][2], DOCUMENTS[0][3]), chat=False)
    costs = report.setdefault("costs", {})
    for context in args.cost_contexts:
        tokens = mx.array([ids[: context + 4]])
        cache, head_cache = trunk.make_cache(), head.make_cache()
        out = trunk(tokens[:, :context], cache)
        hidden = out.hidden_pre_norm if head.hidden_source == "pre_norm" else out.hidden_post_norm
        mx.eval(head(hidden[:, :-1], tokens[:, 1:context], head_cache), [c.state for c in cache])
        x, token = hidden[:, -1:], tokens[:, context : context + 1]
        times: dict[str, list[float]] = {**{f"verify_{k}": [] for k in range(1, 5)}, "head_step": []}
        for _ in range(args.cost_reps):
            for k in range(1, 5):
                start = time.perf_counter()
                mx.eval(trunk(tokens[:, context : context + k], cache).logits)
                times[f"verify_{k}"].append(time.perf_counter() - start)
                rollback.trim_kv(cache, k)
            start = time.perf_counter()
            mx.eval(mx.argmax(head.logits(head(x, token, head_cache))[:, -1], axis=-1))
            times["head_step"].append(time.perf_counter() - start)
            rollback.trim_kv(head_cache, 1)
        costs[str(context)] = {
            name: {"min_ms": round(1e3 * min(t), 3), "median_ms": round(1e3 * float(np.median(t)), 3)}
            for name, t in times.items()
        }
        save()
        print(f"costs at {context}: {json.dumps(costs[str(context)])}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------- summaries


def first_draft_mean(row: dict, temperature: float) -> float:
    values = [k if temperature == 0 else a for _, k, a in row["first_drafts"]]
    return float(np.mean(values)) if values else float("nan")


def mean_se(values) -> dict:
    v = np.asarray(values, dtype=float)
    v = v[~np.isnan(v)]
    se = float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else None
    return {
        "n": int(len(v)),
        "mean": round(float(v.mean()), 4) if len(v) else None,
        "se": se and round(se, 4),
    }


def bin_label(lo: int, hi: int) -> str:
    return f"{lo}-{hi}"


def human_bins(human: dict, bins=BINS, block: int = 64) -> dict:
    """Per setting, kind group and position bin: the mean over positions, with a standard error over
    ``block``-position batch means (neighbouring positions of one text are not independent)."""
    out: dict = {}
    groups = {"all": list(human)}
    for source, h in human.items():
        groups.setdefault(h["kind"], []).append(source)
    for setting in SETTINGS:
        out[setting] = {}
        for group, sources in groups.items():
            row = {}
            for lo, hi in zip(bins[:-1], bins[1:]):
                values, batches = [], []
                for source in sources:
                    h = human[source]
                    a = np.asarray(h[setting], dtype=float)
                    context = np.arange(len(a)) + h["first_context"]
                    part = a[(context >= lo) & (context < hi)]
                    values.append(part)
                    batches += [b.mean() for b in np.array_split(part, max(1, len(part) // block)) if len(b)]
                pooled = np.concatenate(values) if values else np.array([])
                if len(pooled):
                    se = (
                        float(np.std(batches, ddof=1) / math.sqrt(len(batches))) if len(batches) > 1 else None
                    )
                    row[bin_label(lo, hi)] = {
                        "n": int(len(pooled)),
                        "mean": round(float(pooled.mean()), 4),
                        "se": se and round(se, 4),
                    }
            out[setting][group] = row
    return out


def decoding_bins(rows: list[dict], bins=BINS) -> dict:
    """First drafts of the depth-1 decodes by the context they were drafted at (SE over cycles)."""
    out: dict = {}
    for setting, temperature in SETTINGS.items():
        out[setting] = {}
        for lo, hi in zip(bins[:-1], bins[1:]):
            values = [
                k if temperature == 0 else a
                for r in rows
                if r["setting"] == setting and r["variant"] == "d1"
                for c, k, a in r["first_drafts"]
                if lo <= c < hi
            ]
            if values:
                out[setting][bin_label(lo, hi)] = mean_se(values)
    return out


def by_length(rows: list[dict]) -> dict:
    """Documents' depth-1 decodes per prompt length: first-draft acceptance and tokens per cycle."""
    out: dict = {}
    for setting, temperature in SETTINGS.items():
        out[setting] = {}
        chosen = [
            r
            for r in rows
            if r["setting"] == setting and r["variant"] == "d1" and not r["kind"].startswith("chat")
        ]
        for length in sorted({r["prompt_tokens"] for r in chosen}):
            at = [r for r in chosen if r["prompt_tokens"] == length]
            values = [k if temperature == 0 else a for r in at for _, k, a in r["first_drafts"]]
            out[setting][str(length)] = {
                **mean_se(values),
                "per_source": {r["source"]: round(first_draft_mean(r, temperature), 4) for r in at},
                "tokens_per_cycle": round(pooled_tau(at), 4),
            }
    return out


def pooled_tau(rows: list[dict]) -> float:
    cycles = sum(r["cycles"] for r in rows)
    return sum(r["tokens_per_cycle"] * r["cycles"] for r in rows) / max(cycles, 1)


# Without a costs stage: a cycle is 1 AR step + 0.12 per verified draft + 0.05 per head step, the
# profiler's short-context costs on a quiet machine (RESULTS.md "Where the time goes"; the
# defaults of drafter_bounds.py).
PROFILED_COSTS = {
    **{f"verify_{k}": {"min_ms": 1.0 + 0.12 * (k - 1)} for k in range(1, 5)},
    "head_step": {"min_ms": 0.05},
}


def cycle_cost(costs: dict, drafts: float) -> float:
    """A cycle drafting ``drafts`` tokens on average, in AR steps: the verify of 1 + drafts tokens
    (linear between the timed counts) plus the head steps, from the fastest tries."""
    verify = [costs[f"verify_{k}"]["min_ms"] for k in range(1, 5)]
    v = float(np.interp(1 + drafts, [1, 2, 3, 4], verify))
    return (v + drafts * costs["head_step"]["min_ms"]) / verify[0]


def speed(rows: list[dict], costs: dict | None = None) -> dict:
    """Per setting and variant, over the blocks where every variant ran: tokens per cycle, drafts per
    cycle, first-draft acceptance, and the medians of paired tok/s ratios (each run over its own
    block's depth-1 and AR runs), with the ratio's quartiles."""
    blocks: dict = {}
    for r in rows:
        blocks.setdefault((r["source"], r["prompt_tokens"], r["setting"]), {})[r["variant"]] = r
    names = max((list(b) for b in blocks.values()), key=len, default=[])
    full = {k: b for k, b in blocks.items() if len(b) == len(names) and len(names) > 1}
    out: dict = {}
    for setting, temperature in SETTINGS.items():
        chosen = [b for (_, _, s), b in full.items() if s == setting]
        if not chosen:
            continue
        table = {}
        for name in names:
            runs = [b[name] for b in chosen]
            entry = {
                "blocks": len(chosen),
                "tokens_per_cycle": round(pooled_tau(runs), 4),
                "drafts_per_cycle": round(float(np.mean([r["drafts_per_cycle"] for r in runs])), 3),
                "decode_tokens_per_sec_median": round(
                    float(np.median([r["decode_tokens_per_sec"] for r in runs])), 3
                ),
            }
            if name != "ar":
                values = [
                    x for r in runs for x in ([k if temperature == 0 else a for _, k, a in r["first_drafts"]])
                ]
                entry["first_draft"] = mean_se(values)
            for base in ("d1", "ar"):
                ratios = [b[name]["decode_tokens_per_sec"] / b[base]["decode_tokens_per_sec"] for b in chosen]
                q1, med, q3 = np.percentile(ratios, [25, 50, 75])
                entry[f"x_{base}"] = {
                    "median": round(float(med), 4),
                    "q1": round(float(q1), 4),
                    "q3": round(float(q3), 4),
                }
            if costs:
                entry["modelled_x_ar"] = round(
                    entry["tokens_per_cycle"] / cycle_cost(costs, entry["drafts_per_cycle"]), 4
                )
            table[name] = entry
        # The adaptive gate against the best fixed depth >= 2 (by median x d1), paired per block.
        fixed2 = max((n for n in names if n in ("d2", "d3")), key=lambda n: table[n]["x_d1"]["median"])
        adaptive = next(n for n in names if n.startswith("adaptive"))
        ratios = [b[adaptive]["decode_tokens_per_sec"] / b[fixed2]["decode_tokens_per_sec"] for b in chosen]
        table["best_fixed_depth_2_plus"] = fixed2
        table["adaptive_x_best_depth_2_plus"] = round(float(np.median(ratios)), 4)
        out[setting] = table
    return out


def nearest_costs(report: dict, context: int) -> dict | None:
    costs = report.get("costs") or {}
    return costs[min(costs, key=lambda c: abs(int(c) - context))] if costs else PROFILED_COSTS


def summarize(report: dict) -> dict:
    contexts = report.get("contexts", [])
    long_rows = [r for r in contexts if r["prompt_tokens"] >= int(report.get("long_from", 3000))]
    return {
        "human_teacher_forced": human_bins(report["human"]) if report.get("human") else {},
        "decoding_by_context": decoding_bins(contexts + report.get("suite", [])),
        "decoding_by_context_documents": decoding_bins(
            [r for r in contexts if not r["kind"].startswith("chat")]
        ),
        "decoding_by_context_chats": decoding_bins([r for r in contexts if r["kind"].startswith("chat")]),
        "decoding_suite": decoding_bins(report.get("suite", [])),
        "documents_by_length": by_length(contexts),
        "spot_checks": [
            {"source": r["source"], "prompt_tokens": r["prompt_tokens"], **r["spot_check"]}
            for r in contexts
            if "spot_check" in r
        ],
        "speed_long_context": speed(long_rows, nearest_costs(report, 3584)),
        "speed_suite": speed(report.get("suite", []), nearest_costs(report, 0)),
    }


def cell(v: dict | None) -> str:
    if not v or v.get("mean") is None:
        return "-"
    return (
        f"{v['mean']:.3f} ± {v['se']:.3f} ({v['n']})"
        if v.get("se") is not None
        else f"{v['mean']:.3f} ({v['n']})"
    )


def markdown(summary: dict) -> str:
    """The tables RESULTS.md shows, from a summary."""
    lines = []
    human = summary.get("human_teacher_forced", {})
    labels = [bin_label(lo, hi) for lo, hi in zip(BINS[:-1], BINS[1:])]
    lines += ["| context bin | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for setting in SETTINGS:
        for group, row in human.get(setting, {}).items():
            lines.append(
                f"| {setting}, human text TF: {group} | "
                + " | ".join(cell(row.get(b)) for b in labels)
                + " |"
            )
        for what in ("", "_documents", "_chats"):
            row = summary.get(f"decoding_by_context{what}", {}).get(setting, {})
            name = what.strip("_") or "all, with the suite"
            lines.append(
                f"| {setting}, **decoding d=1**: {name} | "
                + " | ".join(cell(row.get(b)) for b in labels)
                + " |"
            )
    by_len = summary.get("documents_by_length", {})
    lengths = sorted({int(k) for s in by_len.values() for k in s})
    if lengths:
        lines += [
            "",
            "| documents, prompt length | " + " | ".join(map(str, lengths)) + " |",
            "|---" * (len(lengths) + 1) + "|",
        ]
        for setting, row in by_len.items():
            lines.append(
                f"| {setting}: first draft | " + " | ".join(cell(row.get(str(n))) for n in lengths) + " |"
            )
            lines.append(
                f"| {setting}: tokens/cycle | "
                + " | ".join(
                    f"{row[str(n)]['tokens_per_cycle']:.2f}" if str(n) in row else "-" for n in lengths
                )
                + " |"
            )
    for name in ("speed_suite", "speed_long_context"):
        table = summary.get(name, {})
        for setting, entries in table.items():
            lines += [
                "",
                f"{name}, {setting} ({entries['best_fixed_depth_2_plus']} is the best depth >= 2; adaptive / it, "
                f"median paired: {entries['adaptive_x_best_depth_2_plus']:.3f})",
                "",
                "| variant | blocks | tokens/cycle | drafts/cycle | first draft | x d=1 (median [q1-q3]) | x AR | modelled x AR |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for variant, e in entries.items():
                if not isinstance(e, dict):
                    continue
                x1, xa = e["x_d1"], e["x_ar"]
                lines.append(
                    f"| {variant} | {e['blocks']} | {e['tokens_per_cycle']:.2f} | {e['drafts_per_cycle']:.2f} | "
                    f"{cell(e.get('first_draft'))} | {x1['median']:.3f} [{x1['q1']:.2f}-{x1['q3']:.2f}] | "
                    f"{xa['median']:.3f} [{xa['q1']:.2f}-{xa['q3']:.2f}] | {e.get('modelled_x_ar', '-')} |"
                )
    for c in summary.get("spot_checks", []):
        lines.append(
            f"\nspot check {c['source']} at {c['prompt_tokens']} tokens: {c['cycles']} cycles, decoding "
            f"{c['decode_first']:.3f}, teacher-forced {c['teacher_forced_same_positions']:.3f}, "
            f"{c['differing_positions']} positions differ"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- the plot


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fine = tuple(range(0, 4096 + PLOT_BIN, PLOT_BIN))
    human = human_bins(report["human"], fine) if report.get("human") else {}
    contexts = report.get("contexts", [])
    decoding = {
        "documents (cut at 0.25k-3.5k)": (
            "s",
            "crimson",
            [r for r in contexts if not r["kind"].startswith("chat")],
        ),
        "long chat (one per turn)": ("D", "purple", [r for r in contexts if r["kind"].startswith("chat")]),
        "suite prompts": ("o", "green", report.get("suite", [])),
    }
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2), sharey=True)
    for ax, setting in zip(axes, SETTINGS):
        for group, row in human.get(setting, {}).items():
            x = [np.mean([int(v) for v in k.split("-")]) for k in row]
            y = [v["mean"] for v in row.values()]
            se = [v["se"] or 0 for v in row.values()]
            style = dict(lw=2.5, color="black") if group == "all" else dict(lw=1, alpha=0.8)
            ax.errorbar(x, y, yerr=se, label=f"human text, teacher-forced: {group}", capsize=2, **style)
        for what, (marker, color, rows) in decoding.items():
            row = decoding_bins(rows).get(setting, {})
            x = [np.mean([int(v) for v in k.split("-")]) for k in row]
            ax.errorbar(
                x,
                [v["mean"] for v in row.values()],
                yerr=[v["se"] or 0 for v in row.values()],
                fmt=marker,
                color=color,
                ms=7,
                capsize=3,
                label=f"real decoding d=1, trunk's own text: {what}",
            )
        ax.set_title(f"{setting}: first-draft acceptance" + (" (1 - TV)" if setting != "greedy" else ""))
        ax.set_xlabel("tokens of context before the drafted token")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("first-draft acceptance")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=7)
    fig.suptitle(f"SmolLM2-135M-Instruct + shipped head, commit {report.get('commit') or '?'}", fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)


# ----------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--stages", default="contexts,suite,human", help="comma-separated: contexts, suite, human"
    )
    ap.add_argument("--tokens", type=int, default=64, help="tokens per decode")
    ap.add_argument("--lengths", default="256,512,1024,2048,3584", help="documents' prompt lengths (tokens)")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--long-from", type=int, default=3000, help="prompts this long run every variant")
    ap.add_argument("--threshold", type=float, default=DEFAULT_ADAPTIVE_THRESHOLD, help="the adaptive gate's")
    ap.add_argument("--suite-per-kind", type=int, default=None, help="suite prompts per kind (default all)")
    ap.add_argument(
        "--spot-check", type=int, default=2, help="documents whose longest decode is teacher-forced"
    )
    ap.add_argument("--sources", default="", help="comma-separated document / chat ids (default: all)")
    ap.add_argument("--cost-contexts", default="128,3584", help="contexts the costs stage times at")
    ap.add_argument("--cost-reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=Path("acceptance-context.json"))
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--report", action="store_true", help="re-summarize (and re-plot) the JSON only")
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    args.cost_contexts = [int(x) for x in args.cost_contexts.split(",") if x.strip()]
    report = json.loads(args.json.read_text()) if args.json.is_file() else {}
    if not args.report:
        engine = Engine.load(prompt_cache_bytes=2 * 1024**3)
        report.update(
            {k: v for k, v in provenance(vars(args)).items() if k != "args"},
            context_length=engine.context_length,
            long_from=args.long_from,
        )
        report.setdefault("args", {}).update({k: str(v) for k, v in vars(args).items()})

        def save() -> None:
            write_json(args.json, report)

        stages = {
            "contexts": stage_contexts,
            "suite": stage_suite,
            "human": stage_human,
            "costs": stage_costs,
        }
        for name in [s.strip() for s in args.stages.split(",") if s.strip()]:
            stages[name](engine, args, report, save)
            report["summary"] = summarize(report)
            save()
    report["summary"] = summarize(report)
    write_json(args.json, report)
    print(markdown(report["summary"]))
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
