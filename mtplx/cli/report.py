"""What the commands print about a generation: mlx-lm's stats lines, then mtplx's drafting lines."""

from __future__ import annotations

__all__ = ["format_stats"]


def format_stats(stats, head=None) -> str:
    """mlx-lm's stats lines (Prompt / Generation / Peak memory), timings, then the drafting lines;
    with ``head`` (the engine's) a split drafter's provenance figure, measured when it loaded."""
    cached = (
        f" ({stats.cached_tokens} cached, {stats.prefilled_tokens} prefilled)" if stats.cached_tokens else ""
    )
    lines = [
        f"Prompt: {stats.prompt_tokens} tokens{cached}, {stats.prefill_tokens_per_sec:.3f} tokens-per-sec",
        f"Generation: {stats.generated_tokens} tokens, {stats.decode_tokens_per_sec:.3f} tokens-per-sec",
        f"Peak memory: {stats.peak_memory_gb:.3f} GB",
        f"Time to first token: {stats.ttft_seconds:.3f} s, total time: {stats.total_seconds:.3f} s",
    ]
    if stats.distributed:
        sharding = stats.distributed  # the mode, the ranks and the collectives' traffic per cycle
        lines.append(
            f"Distributed: {sharding['mode']} over {sharding['ranks']} ranks, per cycle "
            f"{sharding['collectives_per_cycle']} collectives, {sharding['bytes_per_cycle']} bytes"
        )
    if stats.mode != "mtp":
        lines.append("Drafter: none (autoregressive)")
        return "\n".join(lines)
    for name, counts in stats.drafters.items():
        drafted, accepted = counts.get("drafted", 0), counts.get("accepted", 0)
        rate = accepted / drafted if drafted else 0.0
        depth = "" if name == "lookup" else f", depth {stats.depth}"  # lookup blocks have no fixed depth
        lines.append(f"Drafter: {name}{depth}: drafted {drafted}, accepted {accepted} ({rate:.2f})")
    per_position = ", ".join(
        f"{i + 1}: {a:.2f} ({n})"
        for i, (a, n) in enumerate(zip(stats.acceptance_per_position, stats.drafted_per_position))
    )
    lines.append(f"Acceptance per draft position (cycles drafting it): {per_position}")
    lines.append(
        f"Tokens per verify cycle: {stats.tokens_per_cycle:.2f} over {stats.cycles} cycles"
        f" ({stats.tokens_per_full_cycle:.2f} over full cycles)"
    )
    provenance = getattr(head, "provenance", None)
    if provenance is not None:
        lines.append(f"Drafter check: {provenance.describe()} (at load)")
    return "\n".join(lines)
