"""Where a concurrency round's time goes, in process, and what the 4-client >= 2x target needs.

`serve_concurrency.py` times whole rounds through HTTP. This script replays the same rounds on one
`Engine` (`Engine.batch()` with `mtplx serve`'s defaults: drafter auto, draft policy auto,
prefill step 2048, prompt concurrency 8): C closed-loop clients, each sending its ``--requests``
requests back to back, the same prompts in the same order as the server benchmark. A request
joins between cycles, as the server's worker lets it. Each scheduler step is split
(`BatchScheduler.last_timing`) into its decode cycle and the rest (prefill chunks, admissions,
outputs: "prefill" below), and the cycles are grouped by the number of rows decoding.

On a machine whose cores are saturated, a round's wall time is prefill plus decode cycles, and
batching shrinks only the second. So, with T1 the 1-client round's seconds (the same N tokens)
and P4 the 4-client round's prefill seconds, 4 clients reach 2x the 1-client aggregate only if
their decode cycles take at most T1/2 - P4, that is, decode at >= N / (T1/2 - P4) tokens/s
(`required_decode_rate`). The summary sets that rate beside the measured 4-row decode rates, of
the server's defaults (``auto``) and of plain batched AR (``ar``, every request drafts nothing).

    python benchmarks/round_anatomy.py --clients 1,4 --temperatures 0,0.7 --out x.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mtplx.bench.report import provenance, write_json
from mtplx.bench.suite import load_prompts
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.io import atomic_path
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.settings import Drafting

from serve_concurrency import chat_messages  # the server benchmark's chat turns

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"auto": Drafting(), "ar": Drafting(kind="none")}


def required_decode_rate(
    one_client_wall_s: float, prefill_s: float, tokens: int, factor: float = 2.0
) -> float | None:
    """Decode tokens/s a round of ``tokens`` tokens with ``prefill_s`` of prefill needs to reach
    ``factor`` x the aggregate of a round that took ``one_client_wall_s``; None: not reachable at
    any decode rate (the prefill alone takes the whole budget)."""
    budget = one_client_wall_s / factor - prefill_s
    return tokens / budget if budget > 0 else None


def replay_round(
    engine: Engine, prompts: list, request: GenerationRequest, clients: int, requests: int, tag: str
) -> dict:
    """One round: ``clients`` clients, each sending ``requests`` requests one after another."""
    scheduler = engine.batch()
    cycles: list[tuple[int, int, float, int]] = []  # (rows, draft length K, seconds, tokens committed)
    queues = [
        [chat_messages(prompts[c * requests + j], f"{tag}.{c * requests + j}") for j in range(requests)]
        for c in range(clients)
    ]
    live = {scheduler.submit(queues[c].pop(0), request): c for c in range(clients)}
    tokens = 0
    step_seconds = 0.0
    started = time.perf_counter()
    try:
        while live:
            results = scheduler.step()
            timing = scheduler.last_timing
            step_seconds += timing.seconds
            if timing.rows:
                cycles.append((timing.rows, timing.draft_length, timing.cycle_seconds, timing.cycle_tokens))
            for result in results:
                if result.error is not None:
                    raise result.error
                tokens += len(result.chunk.token_ids)
            for result in results:
                if result.done:
                    client = live.pop(result.handle)
                    if queues[client]:
                        live[scheduler.submit(queues[client].pop(0), request)] = client
        wall = time.perf_counter() - started
    finally:
        scheduler.close()
    by_rows: dict[int, list[tuple[float, int]]] = {}
    by_width: dict[int, dict[int, list[tuple[float, int]]]] = {}
    for rows, k, seconds, committed in cycles:
        by_rows.setdefault(rows, []).append((seconds, committed))
        by_width.setdefault(rows, {}).setdefault(k, []).append((seconds, committed))
    decode_seconds = sum(seconds for _, _, seconds, _ in cycles)
    num_requests = clients * requests
    return {
        "wall_s": wall,
        "tokens": tokens,
        "tok_s": tokens / wall,
        # The steps minus their cycles: prefill chunks, admissions (first tokens), outputs.
        "prefill_s": step_seconds - decode_seconds,
        "decode_s": decode_seconds,
        "decode_tok_s": (tokens - num_requests) / decode_seconds,  # first tokens come from admission
        "by_rows": {  # committed tokens (a request's last cycle may commit past max_tokens)
            rows: {
                "cycles": len(cells),
                "seconds": sum(s for s, _ in cells),
                "median_cycle_ms": 1000 * statistics.median(s for s, _ in cells),
                "tok_s": sum(n for _, n in cells) / sum(s for s, _ in cells),
                "tokens_per_row_cycle": sum(n for _, n in cells) / (rows * len(cells)),
            }
            for rows, cells in sorted(by_rows.items())
        },
        "cycle_ms_by_draft_length": {  # rows -> K -> cycles, median ms, tokens per cycle
            rows: {
                k: {
                    "cycles": len(cells),
                    "median_cycle_ms": 1000 * statistics.median(s for s, _ in cells),
                    "tokens_per_cycle": sum(n for _, n in cells) / len(cells),
                }
                for k, cells in sorted(by_k.items())
            }
            for rows, by_k in sorted(by_width.items())
        },
    }


def summarize(runs: list[dict]) -> list[dict]:
    """Per (temperature, variant, repetition): the 1- and 4-client rounds side by side and the
    decode rate 4 clients need for 2x (`required_decode_rate`)."""
    cells = []
    keys = sorted({(r["temperature"], r["variant"], r["repetition"]) for r in runs})
    for temperature, variant, repetition in keys:
        by_clients = {
            r["clients"]: r
            for r in runs
            if (r["temperature"], r["variant"], r["repetition"]) == (temperature, variant, repetition)
        }
        one, four = by_clients.get(1), by_clients.get(4)
        if one is None or four is None:
            continue
        steady = four["by_rows"].get(4)
        cells.append(
            {
                "temperature": temperature,
                "variant": variant,
                "repetition": repetition,
                "one_client_tok_s": one["tok_s"],
                "four_client_tok_s": four["tok_s"],
                "four_over_one": four["tok_s"] / one["tok_s"],
                "prefill_share_one": one["prefill_s"] / one["wall_s"],
                "prefill_share_four": four["prefill_s"] / four["wall_s"],
                "one_row_decode_tok_s": one["decode_tok_s"],
                "four_row_decode_tok_s": steady["tok_s"] if steady else None,
                "needed_decode_tok_s": required_decode_rate(one["wall_s"], four["prefill_s"], four["tokens"]),
            }
        )
    return cells


def plot(runs: list[dict], path: Path) -> None:
    """One bar per round, its seconds stacked: prefill, then the decode cycles by how many rows
    they decoded, then the rest (submitting between steps). Over each 4-client bar a black tick
    at half its 1-client round: the 2x target is that bar reaching down to the tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in runs})
    max_rows = max(int(n) for r in runs for n in r["by_rows"])
    colors = plt.get_cmap("viridis")
    fig, axes = plt.subplots(1, len(temperatures), figsize=(7 * len(temperatures), 5), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        rounds = sorted(
            (r for r in runs if r["temperature"] == temperature),
            key=lambda r: (r["variant"], r["repetition"], r["clients"]),
        )
        for x, r in enumerate(rounds):
            bottom = r["prefill_s"]
            ax.bar(x, bottom, color="lightgray", label="prefill" if x == 0 else None)
            for rows in range(1, max_rows + 1):
                seconds = r["by_rows"].get(str(rows), r["by_rows"].get(rows, {})).get("seconds", 0.0)
                ax.bar(
                    x,
                    seconds,
                    bottom=bottom,
                    color=colors(rows / max_rows),
                    label=f"decode, {rows} row{'s' if rows > 1 else ''}",
                )
                bottom += seconds
            ax.bar(x, r["wall_s"] - bottom, bottom=bottom, color="white", edgecolor="gray", hatch="//")
            ax.annotate(f"{r['tok_s']:.1f}", (x, r["wall_s"]), ha="center", va="bottom", fontsize=8)
            one = next(
                (
                    o
                    for o in rounds
                    if o["clients"] == 1
                    and (o["variant"], o["repetition"]) == (r["variant"], r["repetition"])
                ),
                None,
            )
            if r["clients"] == 4 and one is not None:
                ax.plot([x - 0.4, x + 0.4], [one["wall_s"] / 2] * 2, color="black", linewidth=2)
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=8)
        ax.set_xticks(
            range(len(rounds)),
            [
                f"{r['variant']} r{r['repetition']}\n{r['clients']} client{'s' if r['clients'] > 1 else ''}"
                for r in rounds
            ],
            fontsize=8,
        )
        ax.set_ylabel("seconds per round (bar labels: aggregate tok/s)")
        ax.set_title(f"temperature {temperature:g}; black tick: half the 1-client round (the 2x target)")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("8 requests in one round, in process: where the seconds go")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,4", help="client counts, comma-separated (default 1,4)")
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--variants", default="auto,ar", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument(
        "--requests", type=int, default=None, help="requests per client (default: 8 / clients)"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repetitions", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "round-anatomy.json")
    parser.add_argument(
        "--replot", type=Path, help="only draw the plot of this earlier run's JSON (next to it)"
    )
    args = parser.parse_args()
    if args.replot is not None:
        runs = json.loads(args.replot.read_text())["runs"]
        plot(runs, args.replot.with_suffix(".png"))
        print(f"wrote {args.replot.with_suffix('.png')}")
        return
    client_counts = [int(c) for c in args.clients.split(",")]
    variants = args.variants.split(",")
    engine = Engine.load()
    engine.batch_cost_profile()  # measured once, outside every timed round
    suite = load_prompts()
    runs: list[dict] = []
    for repetition in range(args.repetitions):
        for temperature in (float(t) for t in args.temperatures.split(",")):
            for name in variants if repetition % 2 == 0 else variants[::-1]:
                for clients in client_counts:
                    # Every round sends the same requests (the 1-client round the 4-client round's
                    # eight), chosen as serve_concurrency.py chooses them.
                    requests = args.requests or max(1, 8 // clients)
                    first = repetition * clients * requests
                    prompts = [suite[(first + n) % len(suite)] for n in range(clients * requests)]
                    request = GenerationRequest(
                        sampler=SamplerConfig(temperature=temperature),
                        max_tokens=args.max_tokens,
                        drafting=VARIANTS[name],
                    )
                    tag = f"{repetition}.{temperature:g}.{name}.{clients}"
                    result = replay_round(engine, prompts, request, clients, requests, tag)
                    runs.append(
                        {
                            "temperature": temperature,
                            "variant": name,
                            "clients": clients,
                            "repetition": repetition,
                            **result,
                        }
                    )
                    rows = ", ".join(
                        f"{n} rows {c['cycles']} cycles {c['tok_s']:.1f} tok/s"
                        for n, c in result["by_rows"].items()
                    )
                    widest = max(result["cycle_ms_by_draft_length"], default=None)
                    costs = ", ".join(
                        f"K={k} {c['median_cycle_ms']:.0f} ms x{c['cycles']}"
                        for k, c in result["cycle_ms_by_draft_length"].get(widest, {}).items()
                    )
                    print(
                        f"t {temperature:g} {name:>4} {clients} clients: {result['tok_s']:5.1f} tok/s over "
                        f"{result['wall_s']:.1f} s (prefill {result['prefill_s']:.1f} s); {rows}; "
                        f"{widest}-row cycles by K: {costs}",
                        flush=True,
                    )
    summary = summarize(runs)
    for cell in summary:
        needed = cell["needed_decode_tok_s"]
        print(
            f"t {cell['temperature']:g} {cell['variant']:>4} rep {cell['repetition']}: 4 clients / 1 = "
            f"{cell['four_over_one']:.2f}; prefill {cell['prefill_share_one']:.0%} / {cell['prefill_share_four']:.0%} "
            f"of the rounds; decode 1 row {cell['one_row_decode_tok_s']:.1f}, 4 rows "
            f"{cell['four_row_decode_tok_s'] or 0:.1f} tok/s; 2x needs "
            + (f"{needed:.1f} tok/s at 4 clients" if needed else "more than the whole budget for prefill")
        )
    write_json(args.out, {**provenance(vars(args)), "summary": summary, "runs": runs})
    plot(runs, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
