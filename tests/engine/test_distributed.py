"""MTP decoding on a trunk sharded over 2 local processes (mlx.launch, ring backend, CPU).

Tiny llama and Qwen3.5-hybrid trunks with their heads are saved to a temp dir so
both ranks load the same files; `distributed_worker.py` is one rank. Both modes are
compared with one process: the sharded trunk's logits over the same tokens within
float32 rounding, and greedy MTP equal to single-process greedy AR up to rounding
ties (tensor mode sums partial products in another order: a token may differ only
where one process's two best candidates tie, `support.decoding`'s rule for batches).
Pipeline mode reproduces one process exactly (greedy, and seeded sampled MTP ==
single-process MTP with the seed); tensor greedy MTP also equals its own sharded AR.
Every rank's caches must equal a from-scratch forward after a run with random accept
patterns. Then the default model through `mtplx generate`, and the failure cases:
mismatched head files, a rank that exits, a rank that hangs.

`mlx.launch` is found wherever the install put it (`mlx_launch_command`); only the
tests that launch processes skip without it, and CI fails on that skip
(scripts/check_skips.py: it is not in tests/expected_skips.txt).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from functools import cache
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx import MtplxError
from mtplx.checkpoints import load as loading
from mtplx.engine import distributed
from mtplx.engine.engine import Engine
from mtplx.heads.forged import build_forged_head, save_forged_head
from mtplx.model_files.fingerprint import model_fingerprint

import mlx.core as mx
import numpy as np
import pytest
from support import checkpoints, models
from support.decoding import same_or_tie
from support.optional import installed
from support.paths import REPO
from support.tokenizer import printable_chars

ROOT = REPO
WORKER = Path(__file__).resolve().parent / "distributed_worker.py"
MAX_TOKENS = 40
SEED = 1234
DEPTH = 3
# Greedy runs under these settings see both accepted and rejected drafts (cf. test_decode).
FAMILIES = {
    "llama": dict(seed=0, context_strength=6.0, head_noise=2.0, family="llama"),
    "qwen3_5": dict(seed=1, head_noise=0.5, family="qwen3_5"),
}

# Sharded logits against one process's: float32 sums in another order (measured: pipeline 0, tensor
# 8e-7 on llama and 3e-5 on the Qwen3.5 hybrid, whose recurrent layers carry the rounding along).
LOGITS_ATOL = 2e-4


def mlx_launch_command() -> list[str] | None:
    """How to start mlx.launch for this interpreter: its console script beside the interpreter
    (a venv's bin/) or in the install's scripts folder (sysconfig), else on PATH, else the function
    that script runs, through this interpreter (mlx ships it: ``mlx._distributed_utils.launch``,
    which has no ``__main__``, so ``python -m`` cannot start it). None only without any of them."""
    beside = [Path(sys.executable).parent / "mlx.launch", Path(sysconfig.get_path("scripts")) / "mlx.launch"]
    for candidate in [*beside, shutil.which("mlx.launch")]:
        if candidate and os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return [str(candidate)]
    if installed("mlx._distributed_utils.launch"):
        runner = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"
        return [sys.executable, "-c", runner]
    return None


LAUNCH = mlx_launch_command()
# Only the tests that start processes need it; the others run everywhere.
launches = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch not found (console script or mlx module)")


def _save_tiny(root: Path, name: str, params: dict) -> dict[str, str]:
    """A tiny trunk as an mlx-lm directory, its head as a forged head, and a second, different head."""
    chars, vocab = printable_chars()
    trunk, head = models.make_loop_pair(vocab_size=vocab, **params)
    model = trunk.model
    model_dir, head_dir, other_dir = root / name, root / f"{name}-head", root / f"{name}-other-head"
    checkpoints.save_model(model_dir, model, max_position_embeddings=4096)
    chars.save_pretrained(str(model_dir))
    manifest = {"trunk_fingerprint": model_fingerprint(model)}
    for out, noise in ((head_dir, 0.0), (other_dir, 0.1)):
        forged = build_forged_head(trunk, head.hidden_source)
        forged.update(head.parameters())
        forged.fc.weight = forged.fc.weight + noise
        save_forged_head(out, forged, manifest)
    return {"model": str(model_dir), "head": str(head_dir), "other_head": str(other_dir)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("distributed")
    return {name: _save_tiny(root, name, params) for name, params in FAMILIES.items()}


def _launch(args: list[str], tmp_path: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + str(ROOT / "tests")}
    # One BLAS thread per rank: two processes on 2 cores oversubscribe (OpenBLAS threads spin).
    command = [*LAUNCH, "-n", "2", "--backend", "ring", "--env", "OPENBLAS_NUM_THREADS=1"]
    command += ["--", sys.executable, *args]
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _run_worker(kind: str, spec: dict, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[dict]]:
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    proc = _launch([str(WORKER), kind, str(spec_path), str(tmp_path)], tmp_path)
    ranks = [tmp_path / f"rank{r}.json" for r in range(2)]
    return proc, [json.loads(p.read_text()) for p in ranks if p.exists()]


def _single_process(paths: dict[str, str]) -> dict:
    return _one_process(paths["model"], paths["head"])


@cache
def _one_process(model: str, head: str) -> dict:
    """One process's engine, prompt ids, greedy AR tokens with the two best log-probabilities at
    each (for the tie rule), and a seeded sampled MTP run (loaded once per model)."""
    engine = Engine.load(model, head=head, depth=DEPTH)
    prompt = "def add(a, b):\n    return a + b\n"
    greedy = dict(max_tokens=MAX_TOKENS, temperature=0.0)
    ids = engine.encode_prompt(prompt)
    ar_greedy = engine.generate(prompt, mtp=False, **greedy).token_ids
    logprobs = _logprobs(engine, ids + ar_greedy[:-1])[len(ids) - 1 :]
    return {
        "engine": engine,
        "prompt": ids,
        "ar_greedy": ar_greedy,
        "ar_top2": [tuple(np.sort(row)[-2:][::-1]) for row in logprobs],
        "mtp_sampled": engine.generate(
            prompt,
            mtp=True,
            max_tokens=MAX_TOKENS,
            temperature=0.9,
            top_p=0.95,
            seed=SEED,
            logit_bias={0: -100.0},
        ).token_ids,
    }


def _logits(engine: Engine, tokens: list[int]) -> np.ndarray:
    """One process's trunk logits at every position of ``tokens`` (float64 for the comparison)."""
    return np.array(engine.trunk(mx.array(tokens)[None]).logits[0].astype(mx.float32), dtype=np.float64)


def _logprobs(engine: Engine, tokens: list[int]) -> np.ndarray:
    logits = _logits(engine, tokens)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def sharded_runs(tiny, tmp_path_factory) -> list[dict]:
    """One launch runs every (model, mode) job; each rank reports what it generated and checked."""
    tmp_path = tmp_path_factory.mktemp("decode")
    jobs = [
        {"name": name, "mode": mode, "depth": DEPTH, **paths}
        for name, paths in tiny.items()
        for mode in ("pipeline", "tensor")
    ]
    spec = {"jobs": jobs, "max_tokens": MAX_TOKENS, "seed": SEED, "other_head": tiny["llama"]["other_head"]}
    proc, ranks = _run_worker("decode", spec, tmp_path)
    assert proc.returncode == 0 and len(ranks) == 2, proc.stderr[-3000:]
    return ranks


@launches
@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_sharded_logits_and_greedy_tokens_match_one_process(tiny, sharded_runs, mode, name):
    """Each rank's sharded trunk, over the prompt and its greedy MTP tokens, gives one process's
    logits on the same tokens within float32 rounding; and those tokens are one process's greedy
    AR, or first differ where its two best candidates tie (then the runs are not compared on)."""
    single = _single_process(tiny[name])
    for rank in sharded_runs:
        run = rank[f"{name}/{mode}"]
        tokens = single["prompt"] + run["mtp_greedy"]
        got = np.array(run["logits"], dtype=np.float64)
        want = _logits(single["engine"], tokens)
        assert got.shape == want.shape, (got.shape, want.shape)
        worst = float(np.abs(got - want).max())
        assert worst <= LOGITS_ATOL, f"{name}/{mode}: logits differ by {worst:.3g}"
        same, _ = same_or_tie(single["ar_greedy"], single["ar_top2"], run["mtp_greedy"])
        assert same, f"{name}/{mode}: {run['mtp_greedy']} vs one process's {single['ar_greedy']}"
    # Negative control: the comparison sees a one-token change of the context (the prompt's last).
    last = len(single["prompt"]) - 1
    changed = [*tokens[:last], (tokens[last] + 1) % single["engine"].trunk.vocab_size, *tokens[last + 1 :]]
    assert float(np.abs(got - _logits(single["engine"], changed)).max()) > 10 * LOGITS_ATOL


@launches
@pytest.mark.parametrize("name", list(FAMILIES))
def test_pipeline_mtp_reproduces_one_process(tiny, sharded_runs, name):
    reference = _single_process(tiny[name])
    for rank in sharded_runs:
        run = rank[f"{name}/pipeline"]
        assert len(run["mtp_greedy"]) == MAX_TOKENS
        assert run["mtp_greedy"] == reference["ar_greedy"]
        assert run["ar_greedy"] == reference["ar_greedy"]
        assert run["mtp_sampled"] == reference["mtp_sampled"]
        assert len(run["mtp_sampled"]) == MAX_TOKENS
        # The comparison means something only if drafts were both accepted and rejected.
        assert any(0 < a < 1 for a in run["acceptance"]), run["acceptance"]
    # A different seed gives a different sample (the seed reaches every rank).
    assert reference["mtp_sampled"] != reference["ar_greedy"]


@launches
@pytest.mark.parametrize("name", list(FAMILIES))
def test_tensor_mtp_greedy_equals_sharded_ar(sharded_runs, name):
    runs = [rank[f"{name}/tensor"] for rank in sharded_runs]
    for run in runs:
        assert len(run["mtp_greedy"]) == MAX_TOKENS
        assert run["mtp_greedy"] == run["ar_greedy"]
    assert runs[0]["mtp_sampled"] == runs[1]["mtp_sampled"]  # both ranks took the same decisions


@launches
@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_every_ranks_caches_equal_a_from_scratch_run(sharded_runs, name, mode):
    layers = []
    for rank in sharded_runs:
        caches = rank[f"{name}/{mode}"]["caches"]
        assert len(caches["patterns"]) >= 2  # at least two different accept counts happened
        assert caches["trunk_diff"] <= 5e-5 and caches["head_diff"] <= 5e-5, caches
        assert caches["control_diff"] > 1e-3, caches  # the comparison sees a one-token change
        assert all(o == caches["committed"] for o in caches["offsets"])
        layers.append(caches["local_layers"])
    total = 2 if name == "llama" else 4
    assert layers == ([total // 2, total // 2] if mode == "pipeline" else [total, total])


@launches
def test_stats_report_the_collectives_of_each_mode(sharded_runs):
    pipeline = sharded_runs[0]["llama/pipeline"]["stats"]
    tensor = sharded_runs[0]["llama/tensor"]["stats"]
    hidden_bytes = (DEPTH + 1) * 32 * 4  # one [1, k+1, hidden] float32 block
    # Rank 0 (last layers): receives the block, then all-gathers it.
    assert pipeline["collective_kinds"] == {"all_gather": 1, "recv_like": 1}
    assert pipeline["bytes_per_cycle"] == 2 * hidden_bytes
    # Tensor parallel: one all-reduce after attention and one after the MLP, per layer.
    assert tensor["collective_kinds"] == {"all_sum": 4}
    assert tensor["bytes_per_cycle"] == 4 * hidden_bytes
    assert sharded_runs[1]["llama/pipeline"]["stats"]["collective_kinds"] == {"all_gather": 1, "send": 1}


def _cli_under_launch(tmp_path: Path, prompt: str, *options: str) -> dict:
    proc = _launch(["-m", "mtplx", "generate", prompt, "--json", "--stats", *options], tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout + proc.stderr[-3000:]  # only rank 0 prints
    return json.loads(lines[0])


@launches
def test_cli_under_mlx_launch_shards_and_only_rank_0_prints(tiny, tmp_path):
    paths = tiny["llama"]
    prompt = "def add(a, b):"
    sharded = _cli_under_launch(
        tmp_path, prompt, "--raw", "--model", paths["model"], "--head", paths["head"], "--max-tokens", "16"
    )
    assert sharded["stats"]["mode"] == "mtp" and sharded["stats"]["distributed"]["mode"] == "pipeline"
    single = Engine.load(paths["model"], head=paths["head"]).generate(prompt, max_tokens=16, mtp=False)
    assert sharded["token_ids"] == single.token_ids


@launches
@pytest.mark.slow  # the CLI test above at full size: the default model split over 2 processes
def test_default_model_pipeline_through_the_cli(tmp_path, default_model_dir):
    prompt = "Write a Python function that reverses a string."
    sharded = _cli_under_launch(tmp_path, prompt, "--max-tokens", "24")
    assert sharded["stats"]["mode"] == "mtp" and sharded["stats"]["distributed"]["mode"] == "pipeline"
    single = Engine.load().generate(prompt, chat=True, max_tokens=24, mtp=False)
    assert sharded["token_ids"] == single.token_ids


@launches
def test_ranks_with_different_head_files_refuse_to_generate(sharded_runs):
    for rank in sharded_runs:
        assert "rank 1 has a different head than rank 0" in rank["mismatch_error"]


@launches
def test_a_rank_that_exits_mid_generation_fails_the_others(tiny, tmp_path):
    spec = {"jobs": [{"depth": DEPTH, **tiny["llama"]}], "timeout": 60}
    proc, ranks = _run_worker("die", spec, tmp_path)
    assert not ranks
    assert "rank 0: a decode step failed" in proc.stderr
    assert "another rank died or the network dropped" in proc.stderr
    assert "Node with rank 0 exited with code 2" in proc.stderr


@launches
def test_a_rank_that_hangs_trips_the_collective_timeout(tiny, tmp_path):
    spec = {"jobs": [{"depth": DEPTH, **tiny["llama"]}], "timeout": 3}
    proc, ranks = _run_worker("hang", spec, tmp_path)
    assert not ranks
    assert "rank 0: a decode step did not finish within the collective timeout of 3 s" in proc.stderr
    assert f"Node with rank 0 exited with code {distributed.EXIT_COLLECTIVE_TIMEOUT}" in proc.stderr


@launches
def test_the_launcher_found_here_starts_a_group_of_two(tmp_path):
    """Whichever form `mlx_launch_command` found (console script or mlx's own function) starts
    ranks that form one group; the function form, the last resort, does so as well."""
    hello = "import mlx.core as mx; g = mx.distributed.init(); print(f'rank {g.rank()} of {g.size()}')"
    runner = "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"
    for launch in (LAUNCH, [sys.executable, "-c", runner]):
        command = [*launch, "-n", "2", "--backend", "ring", "--", sys.executable, "-c", hello]
        proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        # The launcher relays both ranks' output to one stream, so their lines may interleave
        # (seen: "rank 0 of 2rank 1 of 2\n\n"): count the messages, not the lines.
        found = sorted(re.findall(r"rank \d+ of \d+", proc.stdout))
        assert found == ["rank 0 of 2", "rank 1 of 2"], proc.stdout


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_lazy_load_fingerprints_the_files_like_the_loaded_parameters(tiny, name):
    """Sharded loads are lazy and fingerprint the files (never materializing other ranks' layers)."""
    lazy = loading.load_model(tiny[name]["model"], lazy=True).fingerprint
    assert lazy == loading.load_model(tiny[name]["model"]).fingerprint
    other = loading.load_model(tiny["qwen3_5" if name == "llama" else "llama"]["model"], lazy=True)
    assert other.fingerprint != lazy


def test_default_model_lazy_fingerprint_matches(default_model_dir):
    assert loading.load_model(default_model_dir, lazy=True).fingerprint == (
        loading.load_model(default_model_dir).fingerprint
    )


def test_a_model_without_any_sharding_mode_is_named():
    from mtplx.trunk.model import Trunk

    trunk = Trunk(models.tiny_gemma3())
    with pytest.raises(MtplxError, match="'gemma3_text' supports neither pipeline nor tensor"):
        distributed.choose_mode(trunk.model, trunk.inner, "auto", {"model_type": "gemma3_text"})


def test_tensor_parallel_refuses_head_counts_that_do_not_split():
    """The default model's shape: 9 query / 3 KV heads do not split over 2 ranks (pipeline does)."""
    model = models.tiny_llama(16, hidden_size=72, num_heads=9, num_kv_heads=3)
    with pytest.raises(MtplxError, match=r"num_attention_heads \(9\) divisible by 2 ranks"):
        distributed.check_tensor_split(model, 2, {"model_type": "llama"})
    distributed.check_tensor_split(model, 3, {"model_type": "llama"})  # 9 and 3 split over 3
    assert distributed.choose_mode(model, model.model, "auto", {}) == "pipeline"


def test_distributed_without_a_launch_group_is_refused(tiny):
    with pytest.raises(MtplxError, match="not part of a group"):
        Engine.load(tiny["llama"]["model"], head=tiny["llama"]["head"], distributed="pipeline")


def test_unknown_distributed_mode_is_refused(tiny):
    with pytest.raises(MtplxError, match="distributed: must be"):
        Engine.load(tiny["llama"]["model"], distributed="rows")
