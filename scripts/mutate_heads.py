"""Plant known head bugs in a scratch copy of the repository and check each family's reference test fails.

"Greedy MTP == AR" cannot catch a wrong head (exact verification keeps the trunk's tokens
whatever the drafts are), so each head family's float64 reference test must. For every family
this plants, one at a time, in a copy under a temporary directory (never in the working tree):
the position-0 embedding mask flipped (added where the family has none, dropped where it has
one), the embedding / hidden concatenation order swapped, a norm dropped, and one bug of the
family's own; then runs that family's reference tests with ``PYTHONPATH`` at the copy. The
unmutated copy runs first: a family whose tests fail clean is reported, not counted.

    python scripts/mutate_heads.py [--families longcat,mimo] [--markdown]

Prints a table family x mutation -> caught (a reference assertion failed) / MISSED (the tests still
pass) / error (an exception, or a collection / fixture error: the plant broke the code, which
proves nothing about the reference, so it counts as not caught). Exit status 1 unless every planted
bug is caught. The table of the last run is in ``tests/heads/README.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MUTATIONS = ("position-0 mask flipped", "concat order swapped", "norm dropped", "family-specific")


@dataclass(frozen=True)
class Plant:
    """One planted bug: ``edits`` are (file, exact text, replacement); each text occurs exactly once."""

    mutation: str
    what: str
    edits: tuple[tuple[str, str, str], ...]


def _stack_mask(path: str, after: str, value: bool) -> tuple[str, str, str]:
    """Set a ``ModuleStackHead`` family's ``zero_position_zero`` to ``value`` right after ``after``."""
    return (path, after, f"{after}\n    zero_position_zero = {value}")


_EMB_FIRST = "mx.concatenate([e, m.hnorm(hidden).astype(e.dtype)], axis=-1)"
_EMB_SWAPPED = "mx.concatenate([m.hnorm(hidden).astype(e.dtype), e], axis=-1)"
_OWN_HEAD = 'return m["lm_head"](head_hidden) if "lm_head" in m else self._shared_lm_head(head_hidden)'
# The DeepSeek-style module's math, shared by deepseek, step3p5, mimo_v2_flash, longcat and hy_v4:
# the bugs in it are planted there, and each of those families' references must catch them.
_EH = "mtplx/heads/eh_proj.py"
_EH_SWAP = ((_EH, _EMB_FIRST, _EMB_SWAPPED),)
_EH_HNORM = ((_EH, "m.hnorm(hidden).astype", "hidden.astype"),)
_EH_FINAL_NORM = ((_EH, "return m.final_layernorm", "return nn.Identity()"),)
_EH_OWN_HEAD = ((_EH, _OWN_HEAD, "return self._shared_lm_head(head_hidden)"),)
_QWEN = "mtplx/heads/qwen3_next.py"
_QWEN_MASK = (
    (
        _QWEN,
        "e = self.pre_fc_norm_embedding(self._embed(next_tokens))",
        "from mtplx.heads.base import zero_first_position\n"
        "        e = self.pre_fc_norm_embedding(zero_first_position(self._embed(next_tokens), 0))",
    ),
)
_QWEN_SWAP = (
    (
        _QWEN,
        "mx.concatenate([e, h.astype(e.dtype)], axis=-1)",
        "mx.concatenate([h.astype(e.dtype), e], axis=-1)",
    ),
)
_QWEN_NORM = ((_QWEN, "h = self.pre_fc_norm_hidden(hidden)", "h = hidden"),)

_NEMOTRON = "mtplx/heads/nemotron_h.py"
_NEMOTRON_CONCAT = "mx.concatenate([e, first.hnorm(hidden).astype(e.dtype)], axis=-1)"

_HY = "mtplx/heads/hy_v4.py"
_Q4 = "mtplx/heads/qwen4_exp.py"
_Q4_EMBED = "e = self.fc_embedding(self.pre_fc_norm_embedding(self._embed(next_tokens)))"
_DSV4 = "mtplx/heads/deepseek_v4.py"
_DSV4_EMBED = "e = self.e_proj(self.enorm(self._embed(next_tokens)))"
_GLM5N = "mtplx/heads/glm5_next.py"
_INK = "mtplx/heads/inkling.py"
_INK_CONCAT = "mx.concatenate([block.hidden_norm(hidden), block.embed_norm(embedded)], axis=-1)"
_GEMMA = "mtplx/heads/gemma4_assistant.py"
_GEMMA_EMBED = "self._embed(next_tokens[:, -1:])"
_GEMMA_CONCAT = f"mx.concatenate([{_GEMMA_EMBED}, hidden[:, -1:]], axis=-1)"

PLANTS: dict[str, tuple[Plant, ...]] = {
    "qwen3_next": (
        Plant(MUTATIONS[0], "position 0's embedding zeroed", _QWEN_MASK),
        Plant(MUTATIONS[1], "[hidden, embedding]", _QWEN_SWAP),
        Plant(MUTATIONS[2], "pre_fc_norm_hidden dropped", _QWEN_NORM),
        Plant(
            MUTATIONS[3],
            "1+w norms read as plain",
            ((_QWEN, "return plain_norms(weights, rule, str(src.source))", "return weights"),),
        ),
    ),
    "forged": (
        Plant(MUTATIONS[0], "position 0's embedding zeroed", _QWEN_MASK),
        Plant(MUTATIONS[1], "[hidden, embedding]", _QWEN_SWAP),
        Plant(MUTATIONS[2], "pre_fc_norm_hidden dropped", _QWEN_NORM),
        Plant(
            MUTATIONS[3],
            "one layer per draft step, not all in sequence",
            ((_QWEN, "layer_per_step: bool = False,", "layer_per_step: bool = True,"),),
        ),
    ),
    "deepseek": (
        Plant(
            MUTATIONS[0],
            "position-0 mask dropped",
            (("mtplx/heads/deepseek.py", "zero_position_zero = True", "zero_position_zero = False"),),
        ),
        Plant(MUTATIONS[1], "[hidden, embedding]", _EH_SWAP),
        Plant(MUTATIONS[2], "hnorm dropped", _EH_HNORM),
        Plant(MUTATIONS[3], "the module's own shared_head.head ignored", _EH_OWN_HEAD),
    ),
    "mimo": (
        Plant(
            MUTATIONS[0],
            "position-0 mask dropped",
            (_stack_mask("mtplx/heads/mimo.py", "    module_class = MiMoMTPModule", False),),
        ),
        Plant(
            MUTATIONS[1],
            "[embedding, hidden]",
            (
                (
                    "mtplx/heads/mimo.py",
                    "[m.hidden_layernorm(hidden).astype(e.dtype), e]",
                    "[e, m.hidden_layernorm(hidden).astype(e.dtype)]",
                ),
            ),
        ),
        Plant(
            MUTATIONS[2],
            "hidden_layernorm dropped",
            (("mtplx/heads/mimo.py", "m.hidden_layernorm(hidden).astype", "hidden.astype"),),
        ),
        Plant(
            MUTATIONS[3],
            "final norm read from token_layernorm",
            (("mtplx/heads/mimo.py", "return m.final_layernorm", "return m.token_layernorm"),),
        ),
    ),
    "mimo_v2_flash": (
        Plant(
            MUTATIONS[0],
            "position 0's embedding zeroed",
            (("mtplx/heads/mimo_v2_flash.py", "zero_position_zero = False", "zero_position_zero = True"),),
        ),
        Plant(MUTATIONS[1], "[hidden, embedding]", _EH_SWAP),
        Plant(MUTATIONS[2], "hnorm dropped", _EH_HNORM),
        Plant(
            MUTATIONS[3],
            "plain KV cache: no sliding window",
            (("mtplx/heads/mimo_v2_flash.py", "        cache_like=[idx] * num_layers,\n", ""),),
        ),
    ),
    "step3p5": (
        Plant(
            MUTATIONS[0],
            "position 0's embedding zeroed",
            (("mtplx/heads/step3p5.py", "zero_position_zero = False", "zero_position_zero = True"),),
        ),
        Plant(MUTATIONS[1], "[hidden, embedding]", _EH_SWAP),
        Plant(MUTATIONS[2], "hnorm dropped", _EH_HNORM),
        Plant(MUTATIONS[3], "the layer's own shared_head.output ignored", _EH_OWN_HEAD),
    ),
    "longcat": (
        Plant(
            MUTATIONS[0],
            "position 0's embedding zeroed",
            (("mtplx/heads/longcat.py", "zero_position_zero = False", "zero_position_zero = True"),),
        ),
        Plant(MUTATIONS[1], "[hidden, embedding]", _EH_SWAP),
        Plant(
            MUTATIONS[2],
            "post_attention_layernorm dropped",
            (("mtplx/heads/longcat.py", "self.mlp(self.post_attention_layernorm(h))", "self.mlp(h)"),),
        ),
        Plant(MUTATIONS[3], "model.mtp.norm not applied", _EH_FINAL_NORM),
    ),
    "ernie": (
        Plant(
            MUTATIONS[0],
            "position-0 mask dropped",
            (_stack_mask("mtplx/heads/ernie.py", "    module_class = ErnieMTPModule", False),),
        ),
        Plant(
            MUTATIONS[1],
            "[hidden, embedding]",
            (
                (
                    "mtplx/heads/ernie.py",
                    "[e, m.mtp_hidden_norm(hidden).astype(e.dtype)]",
                    "[m.mtp_hidden_norm(hidden).astype(e.dtype), e]",
                ),
            ),
        ),
        Plant(
            MUTATIONS[2],
            "mtp_hidden_norm dropped",
            (("mtplx/heads/ernie.py", "m.mtp_hidden_norm(hidden).astype", "hidden.astype"),),
        ),
        Plant(
            MUTATIONS[3],
            "a final norm where the layer has none",
            (("mtplx/heads/ernie.py", "return _NO_NORM", "return m.mtp_emb_norm"),),
        ),
    ),
    "nemotron_h": (
        Plant(
            MUTATIONS[0],
            "position 0's embedding zeroed",
            (
                (
                    _NEMOTRON,
                    "e = first.enorm(self._embed(next_tokens))",
                    "from mtplx.heads.base import zero_first_position\n"
                    "        e = first.enorm(zero_first_position(self._embed(next_tokens), 0))",
                ),
            ),
        ),
        Plant(
            MUTATIONS[1],
            "[hidden, embedding]",
            (
                (
                    _NEMOTRON,
                    _NEMOTRON_CONCAT,
                    "mx.concatenate([first.hnorm(hidden).astype(e.dtype), e], axis=-1)",
                ),
            ),
        ),
        Plant(MUTATIONS[2], "hnorm dropped", ((_NEMOTRON, "first.hnorm(hidden).astype", "hidden.astype"),)),
        Plant(
            MUTATIONS[3],
            "the MoE block skipped",
            ((_NEMOTRON, "                x = block(x)\n", "                pass\n"),),
        ),
    ),
    "hy_v4": (
        Plant(
            MUTATIONS[0],
            "position 0's embedding zeroed",
            ((_HY, "    zero_position_zero = False", "    zero_position_zero = True"),),
        ),
        Plant(MUTATIONS[1], "[hidden, embedding]", _EH_SWAP),
        Plant(MUTATIONS[2], "final_layernorm dropped", _EH_FINAL_NORM),
        Plant(
            MUTATIONS[3],
            "hidden-stream choice: the pre-norm hyper-connection collapse",
            (
                (
                    _HY,
                    'DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"',
                    'DEFAULT_HIDDEN_SOURCE: HiddenSource = "pre_norm"',
                ),
            ),
        ),
    ),
    "qwen4_exp": (
        Plant(
            MUTATIONS[0],
            "position 0's embedding zeroed",
            (
                (
                    _Q4,
                    _Q4_EMBED,
                    "from mtplx.heads.base import zero_first_position\n"
                    "        e = self.fc_embedding(self.pre_fc_norm_embedding(zero_first_position(self._embed(next_tokens), 0)))",
                ),
            ),
        ),
        # No concatenation: the embedding and the streams have their own projections, swapped here.
        Plant(
            MUTATIONS[1],
            "fc_embedding / fc_hidden swapped",
            (
                (_Q4, _Q4_EMBED, _Q4_EMBED.replace("self.fc_embedding(", "self.fc_hidden(")),
                (_Q4, "+ self.fc_hidden(streams)", "+ self.fc_embedding(streams)"),
            ),
        ),
        Plant(
            MUTATIONS[2],
            "pre_fc_norm_hidden dropped",
            ((_Q4, "streams = self.pre_fc_norm_hidden(hidden).reshape(", "streams = hidden.reshape("),),
        ),
        Plant(
            MUTATIONS[3],
            "hidden-stream choice: the first stream (repeated) instead of all hc_count",
            (
                (
                    _Q4,
                    "e = self.fc_embedding(",
                    "hidden = mx.tile(hidden[..., : hidden.shape[-1] // self.hc_count], self.hc_count)\n"
                    "        e = self.fc_embedding(",
                ),
            ),
        ),
    ),
    "deepseek_v4": (
        Plant(
            MUTATIONS[0],
            "position 0's embedding zeroed",
            (
                (
                    _DSV4,
                    _DSV4_EMBED,
                    "from mtplx.heads.base import zero_first_position\n"
                    "        e = self.e_proj(self.enorm(zero_first_position(self._embed(next_tokens), 0)))",
                ),
            ),
        ),
        # No concatenation: the embedding and the streams have their own projections, swapped here.
        Plant(
            MUTATIONS[1],
            "e_proj / h_proj swapped",
            (
                (_DSV4, _DSV4_EMBED, _DSV4_EMBED.replace("self.e_proj(", "self.h_proj(")),
                (_DSV4, "x = self.h_proj(self.hnorm(", "x = self.e_proj(self.hnorm("),
            ),
        ),
        Plant(
            MUTATIONS[2],
            "hnorm dropped",
            (
                (
                    _DSV4,
                    "self.h_proj(self.hnorm(self._streams(hidden)))",
                    "self.h_proj(self._streams(hidden))",
                ),
            ),
        ),
        Plant(
            MUTATIONS[3],
            "hidden-stream choice: the first stream (repeated) instead of all hc_mult",
            (
                (
                    _DSV4,
                    _DSV4_EMBED,
                    "hidden = mx.tile(hidden[..., : self.args.hidden_size], self.args.hc_mult)\n        "
                    + _DSV4_EMBED,
                ),
            ),
        ),
    ),
    "glm5_next": (
        Plant(
            MUTATIONS[0],
            "position 0's embedding not zeroed",
            (
                (
                    _GLM5N,
                    "embedded = zero_first_position(self._embed(next_tokens), offset)",
                    "embedded = self._embed(next_tokens)",
                ),
            ),
        ),
        Plant(
            MUTATIONS[1],
            "hidden first in the concat",
            (
                (
                    _GLM5N,
                    "mx.concatenate([e, m.hnorm(hidden).astype(e.dtype)], axis=-1)",
                    "mx.concatenate([m.hnorm(hidden).astype(e.dtype), e], axis=-1)",
                ),
            ),
        ),
        Plant(
            MUTATIONS[2],
            "hnorm dropped",
            ((_GLM5N, "m.hnorm(hidden).astype(e.dtype)", "hidden.astype(e.dtype)"),),
        ),
        Plant(
            MUTATIONS[3],
            "hidden-stream choice: the trunk's pre-norm mean of the streams",
            (
                (
                    _GLM5N,
                    'DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"',
                    'DEFAULT_HIDDEN_SOURCE: HiddenSource = "pre_norm"',
                ),
            ),
        ),
    ),
    "inkling": (
        Plant(
            MUTATIONS[0],
            "position 0's embedding zeroed",
            (
                (
                    _INK,
                    "embedded = self._embed(next_tokens)",
                    "from mtplx.heads.base import zero_first_position\n"
                    "        embedded = zero_first_position(self._embed(next_tokens), 0)",
                ),
            ),
        ),
        Plant(
            MUTATIONS[1],
            "[embedding, hidden]",
            (
                (
                    _INK,
                    _INK_CONCAT,
                    "mx.concatenate([block.embed_norm(embedded), block.hidden_norm(hidden)], axis=-1)",
                ),
            ),
        ),
        Plant(
            MUTATIONS[2],
            "hidden_norm dropped",
            ((_INK, "[block.hidden_norm(hidden), block.embed_norm", "[hidden, block.embed_norm"),),
        ),
        Plant(
            MUTATIONS[3],
            "hidden-state choice: the trunk's post-norm (scaled) state",
            (
                (
                    _INK,
                    'DEFAULT_HIDDEN_SOURCE: HiddenSource = "pre_norm"',
                    'DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"',
                ),
            ),
        ),
    ),
    "gemma4_assistant": (
        # It drafts one row at the target's position (> 0): the flip treats that row as position 0.
        Plant(
            MUTATIONS[0],
            "its one row zeroed as position 0",
            (
                (
                    _GEMMA,
                    _GEMMA_CONCAT,
                    _GEMMA_CONCAT.replace(_GEMMA_EMBED, f"mx.zeros_like({_GEMMA_EMBED})"),
                ),
            ),
        ),
        Plant(
            MUTATIONS[1],
            "[hidden, embedding]",
            ((_GEMMA, _GEMMA_CONCAT, f"mx.concatenate([hidden[:, -1:], {_GEMMA_EMBED}], axis=-1)"),),
        ),
        Plant(
            MUTATIONS[2], "final norm dropped", ((_GEMMA, "return self.model.norm", "return nn.Identity()"),)
        ),
        Plant(
            MUTATIONS[3],
            "sliding window one key short",
            ((_GEMMA, "return self.sliding_window if", "return self.sliding_window - 1 if"),),
        ),
    ),
}

_REFS = "tests/heads/test_head_references.py"
# Each family's reference tests (pytest arguments, relative to the repository root).
REFERENCE_TESTS: dict[str, tuple[str, ...]] = {
    "qwen3_next": ("tests/heads/test_heads.py::test_qwen35_head_matches_numpy_reference",),
    "forged": (_REFS, "-k", "forged"),
    "deepseek": (
        "tests/heads/test_heads.py::test_deepseek_head_matches_numpy_reference",
        "tests/heads/test_heads.py::test_deepseek_own_lm_head_copy_that_differs_is_kept_and_drafts",
        "tests/heads/test_glm4_moe.py::test_mtp_layer_matches_a_float64_reference_at_every_position",
    ),
    "mimo": ("tests/heads/test_heads.py::test_mimo_head_matches_numpy_reference",),
    "mimo_v2_flash": (_REFS, "-k", "mimo_v2_flash"),
    "step3p5": (_REFS, "-k", "step3p5"),
    "longcat": (_REFS, "-k", "longcat"),
    "ernie": (_REFS, "-k", "ernie"),
    "nemotron_h": ("tests/heads/test_nemotron_h.py", "-k", "reference or chain"),
    "hy_v4": ("tests/heads/test_hy_v4.py", "-k", "reference or chain"),
    "qwen4_exp": ("tests/heads/test_qwen4_exp.py", "-k", "reference or chain"),
    "deepseek_v4": ("tests/heads/test_deepseek_v4.py", "-k", "reference or chain or drafter"),
    "glm5_next": ("tests/heads/test_glm5_next.py", "-k", "reference or chain or drafter"),
    "inkling": ("tests/heads/test_inkling.py", "-k", "reference or chain"),
    "gemma4_assistant": (
        "tests/heads/test_gemma4.py",
        "-k",
        "test_assistant_forward_matches_the_numpy_reference",
    ),
}


def scratch_copy(dest: Path) -> Path:
    """The package and the tests (what a reference run reads) copied to ``dest``."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for part in ("mtplx", "tests"):
        shutil.copytree(REPO / part, dest / part, ignore=skip)
    for name in ("pyproject.toml", "conftest.py"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, dest / name)
    return dest


def apply(root: Path, plant: Plant) -> dict[Path, str]:
    """Patch the copy; returns the originals to restore. A text not found exactly once is an error."""
    originals: dict[Path, str] = {}
    for rel, old, new in plant.edits:
        path = root / rel
        current = path.read_text()
        originals.setdefault(path, current)
        if current.count(old) != 1:
            raise SystemExit(
                f"{rel}: the text to plant '{plant.what}' occurs {current.count(old)} times, not once"
            )
        path.write_text(current.replace(old, new))
    return originals


_RAISED = re.compile(r"^E\s+(?:[\w.]+\.)?(\w+(?:Error|Exception))\b")


def run_tests(root: Path, family: str, tests: dict[str, tuple[str, ...]] = REFERENCE_TESTS) -> str:
    """``family``'s reference tests in the copy: "passed", "failed" (only assertions failed), or
    "error: ..." (an exception other than an assertion, or a collection / fixture error: the plant
    broke the code, which proves nothing about the reference)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    done = subprocess.run([*cmd, *tests[family]], cwd=root, env=env, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else done.stderr.strip()[-200:]
    if done.returncode == 0:
        return "passed"
    raised = sorted({m.group(1) for m in map(_RAISED.match, lines) if m} - {"AssertionError"})
    if raised:
        return f"error: raised {', '.join(raised)}"
    if done.returncode == 1 and " failed" in summary and " error" not in summary:
        return "failed"
    return f"error: {summary}"


def verdict(outcome: str) -> str:
    return {"passed": "MISSED", "failed": "caught"}.get(outcome, outcome)


def check_family(
    root: Path,
    family: str,
    plants: dict[str, tuple[Plant, ...]] = PLANTS,
    tests: dict[str, tuple[str, ...]] = REFERENCE_TESTS,
) -> list[str]:
    """The clean run's verdict, then one verdict per planted bug (in ``plants[family]``'s order;
    ``scripts/mutate_drafters.py`` passes its own plants and tests)."""
    clean = run_tests(root, family, tests)
    if clean != "passed":
        return [f"fails clean ({clean})"] + ["-"] * len(plants[family])
    row = ["passes"]
    for plant in plants[family]:
        originals = apply(root, plant)
        try:
            row.append(f"{verdict(run_tests(root, family, tests))}: {plant.what}")
        finally:
            for path, text in originals.items():
                path.write_text(text)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(PLANTS), help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in PLANTS]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(PLANTS)}")
    print("| family | clean | " + " | ".join(MUTATIONS) + " |")
    print("|---" * (len(MUTATIONS) + 2) + "|")
    all_caught = True
    with tempfile.TemporaryDirectory(prefix="mtplx-mutants-") as tmp:
        root = scratch_copy(Path(tmp))
        for family in families:
            row = check_family(root, family)
            all_caught &= row[0] == "passes" and all(cell.startswith("caught") for cell in row[1:])
            print(f"| {family} | " + " | ".join(row) + " |", flush=True)
    return 0 if all_caught else 1


if __name__ == "__main__":
    sys.exit(main())
