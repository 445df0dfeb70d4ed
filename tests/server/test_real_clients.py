"""The real coding agents against a started `mtplx serve`: Codex CLI and Claude Code as installed
from npm (pinned versions, cached under the test cache directory), one non-interactive turn each,
Claude Code with its default tools reaching Anthropic's context error, and the recorded sessions
(`fixtures/agents/`) replayed for the turn-2 prompt-cache reuse.

In `make test` the clients talk to a tiny random MiMo checkpoint with the default model's
tokenizer and a 32k context (its prefill of an agent's 3-6k-token prompt takes seconds; the default
model's takes minutes on a 2-core CPU), whose end-of-sequence row is scaled so replies end within
a few tokens, as a real model's turn does. The default model's own turns run under `slow`; the
context error is cheap with it (refused before any prefill), so that one runs here.

The clients run with a HOME and config of their own, every non-essential network feature off, and
only 127.0.0.1 as their endpoint. Without node and npm, or when npm cannot install them, the tests
skip (tests/expected_skips.txt).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)

import httpx
import pytest
from support import checkpoints
from support.paths import REPO
from support.server import running_server, wait_for

CODEX_VERSION = "0.171.0"
CLAUDE_CODE_VERSION = "2.1.197"
FIXTURES = Path(__file__).parent / "fixtures" / "agents"
EOS_ID = 2  # the default tokenizer's <|im_end|>
QUIET_CLAUDE = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
}


def _cache_root() -> Path:
    return Path(os.environ.get("MTPLX_CACHE") or Path.home() / ".cache" / "mtplx")


def _installed(prefix: Path) -> dict[str, Path] | None:
    claude = sorted(prefix.glob("node_modules/@anthropic-ai/claude-code-*/claude"))
    codex = prefix / "node_modules" / ".bin" / "codex"
    return {"claude": claude[0], "codex": codex} if claude and codex.exists() else None


@pytest.fixture(scope="session")
def agent_clients() -> dict[str, Path]:
    """The two clients' executables, installed with npm once per cache directory."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("real agent clients: node and npm are not installed")
    prefix = _cache_root() / "npm-clients" / f"codex-{CODEX_VERSION}-claude-code-{CLAUDE_CODE_VERSION}"
    found = _installed(prefix)
    if found is not None:
        return found
    staging = prefix.with_name(prefix.name + f".tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    packages = [f"@openai/codex@{CODEX_VERSION}", f"@anthropic-ai/claude-code@{CLAUDE_CODE_VERSION}"]
    try:
        done = subprocess.run(
            ["npm", "install", "--prefix", str(staging), "--no-audit", "--no-fund", *packages],
            capture_output=True,
            text=True,
            timeout=900,
        )
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0 or _installed(staging) is None:
        shutil.rmtree(staging, ignore_errors=True)
        why = "timed out" if done is None else (done.stderr.strip().splitlines() or ["no binary"])[-1]
        pytest.skip(f"real agent clients: npm could not install them ({why})")
    shutil.rmtree(prefix, ignore_errors=True)
    staging.rename(prefix)
    return _installed(prefix)


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory, default_model_dir) -> Path:
    """Tiny random MiMo, default tokenizer, 32k context; its EOS row scaled so replies end soon."""
    import mlx.core as mx

    path = tmp_path_factory.mktemp("served") / "tiny-agent"
    checkpoints.mimo(path, vocab_size=49152, seed=0)
    checkpoints.copy_tokenizer(default_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 32768
    (path / "config.json").write_text(json.dumps(config))
    weights = dict(mx.load(str(path / "model.safetensors")))
    head = weights["lm_head.weight"]
    row = head[EOS_ID]
    weights["lm_head.weight"] = head.at[EOS_ID].add(row / mx.linalg.norm(row) * 9.0 - row)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


@pytest.fixture(scope="module")
def agent_server(agent_model, tmp_path_factory):
    """No --api-key, as the README's Codex config (no env_key) and Claude Code section assume."""
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    with running_server(agent_model, log_path, api_key=None) as running:
        yield running


def _readme_codex_config(base: str) -> str:
    """The README's Codex config.toml, as written, pointed at ``base``."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    at = readme.index("Codex (`~/.codex/config.toml`")
    block = re.search(r"```toml\n(.*?)```", readme[at:], re.S).group(1)
    assert "http://127.0.0.1:8000/v1" in block
    return block.replace("http://127.0.0.1:8000", base)


def _run(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 600
) -> subprocess.CompletedProcess:
    base_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
    return subprocess.run(
        args,
        env={**base_env, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def _codex(clients, base: str, home: Path, prompt: str, timeout: float = 600) -> subprocess.CompletedProcess:
    home.mkdir(parents=True, exist_ok=True)
    # No update check and no analytics: nothing leaves the machine but the requests to `base`.
    quiet = "check_for_update_on_startup = false\n"
    config = _readme_codex_config(base)
    (home / "config.toml").write_text(
        quiet + config + "\n[analytics]\nenabled = false\n\n[feedback]\nenabled = false\n"
    )
    env = {"HOME": str(home), "CODEX_HOME": str(home)}
    args = [str(clients["codex"]), "exec", "--skip-git-repo-check", prompt]
    return _run(args, env, home, timeout)


def _claude(clients, base: str, home: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    home.mkdir(parents=True, exist_ok=True)
    env = {"HOME": str(home), "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "unused", **QUIET_CLAUDE}
    return _run([str(clients["claude"]), *args], env, home, timeout)


def _log_lines(log_path: Path, route: str) -> list[str]:
    return [line for line in log_path.read_text().splitlines() if f"POST {route} " in line]


def test_codex_exec_completes_a_turn_with_the_readmes_config(agent_clients, agent_server, tmp_path):
    base, log_path = agent_server
    before = len(_log_lines(log_path, "/v1/responses"))
    done = _codex(agent_clients, base, tmp_path / "codex", "Say hi in five words.")
    assert done.returncode == 0, done.stderr[-2000:]
    wait_for(lambda: len(_log_lines(log_path, "/v1/responses")) > before)
    lines = _log_lines(log_path, "/v1/responses")[before:]
    assert len(lines) == 1 and " 200 " in lines[0] and "(" not in lines[0].split(" 200 ")[1], lines


def test_claude_code_print_completes_a_turn_with_bash_and_read(agent_clients, agent_server, tmp_path):
    """Nothing set but the base URL and a key: no model, no output cap (its own 64,000 max_tokens
    and model name are served as they come)."""
    base, log_path = agent_server
    before = len(_log_lines(log_path, "/v1/messages"))
    done = _claude(
        agent_clients, base, tmp_path / "claude", "-p", "Say hi in five words.", "--tools", "Bash,Read"
    )
    assert done.returncode == 0, (done.stdout[-1000:], done.stderr[-2000:])
    lines = _log_lines(log_path, "/v1/messages")[before:]
    assert lines and all(" 200 " in line and "(error" not in line for line in lines), lines
    assert "HEAD / 200" in log_path.read_text()


def test_claude_code_default_tools_reach_anthropics_context_error_on_the_default_model(
    agent_clients, default_model_dir, tmp_path
):
    """Its default tools make a ~20.8k-token prompt; the default model's context is 8,192: refused
    before any prefill with Anthropic's wording, which Claude Code shows. The fixed draft policy:
    nothing is decoded, and 'auto' would measure the default model's batch cost profile at the
    start (seconds of CPU; a SIGTERM waits for it up to the worker's 10 s join)."""
    log_path = tmp_path / "server.log"
    with running_server(default_model_dir, log_path, "--draft-policy", "fixed", api_key=None) as (base, _):
        done = _claude(agent_clients, base, tmp_path / "claude", "-p", "Say hi.")
        wait_for(lambda: bool(_log_lines(log_path, "/v1/messages")))
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "prompt is too long" in output.lower() or "context" in output.lower(), output[-2000:]
    lines = _log_lines(log_path, "/v1/messages")
    assert lines and all(" 400 " in line for line in lines), lines
    assert "Traceback" not in log_path.read_text()


# ------------------------------------------------------------------ recorded sessions


def _replay(base: str, name: str) -> dict:
    record = json.loads((FIXTURES / name).read_text())
    body = {**record["body"], "stream": False}
    reply = httpx.post(base + record["path"], json=body, headers={"x-api-key": "unused"}, timeout=600)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _cache_read(usage: dict) -> tuple[int, int]:
    """(prompt tokens read from the cache, prompt tokens) in either API's usage."""
    if "cache_read_input_tokens" in usage:
        return usage["cache_read_input_tokens"], usage["input_tokens"] + usage["cache_read_input_tokens"]
    return usage["input_tokens_details"]["cached_tokens"], usage["input_tokens"]


@pytest.mark.parametrize("client", ["claude_code", "codex"])
def test_recorded_sessions_reuse_the_cache_on_turn_two(agent_server, client):
    """Turn 2 of a recorded session (a new process re-sending the whole conversation) reads at
    least 90% of its prompt from the cache turn 1 left. Negative control: Claude Code's turn with
    its instructions changed reads only the tokens before the change."""
    base, _ = agent_server
    turn1 = json.loads((FIXTURES / f"{client}_turn1.json").read_text())["body"]
    if client == "claude_code":
        assert turn1["system"][0]["text"].startswith("x-anthropic-billing-header:")
    _replay(base, f"{client}_turn1.json")
    cached, prompt = _cache_read(_replay(base, f"{client}_turn2.json")["usage"])
    assert cached >= 0.9 * prompt, (cached, prompt)
    if client == "claude_code":  # negative control (once: a full prefill): changed instructions miss
        changed = json.loads((FIXTURES / f"{client}_turn2.json").read_text())
        changed["body"]["system"][1]["text"] = "Changed. " + changed["body"]["system"][1]["text"]
        reply = httpx.post(base + changed["path"], json={**changed["body"], "stream": False}, timeout=600)
        cached_changed, _ = _cache_read(reply.json()["usage"])
        assert cached_changed < 0.1 * prompt, cached_changed


@pytest.mark.slow
def test_default_model_serves_a_codex_turn_and_a_claude_code_turn(agent_clients, default_model_dir, tmp_path):
    """The README's setups on the default model as a user runs them (minutes of prefill on a
    2-core CPU: Codex's prompt is ~6,200 tokens, Claude Code's with Bash and Read ~2,900)."""
    log_path = tmp_path / "server.log"
    with running_server(default_model_dir, log_path, "--request-timeout", "1800", api_key=None) as (base, _):
        codex = _codex(agent_clients, base, tmp_path / "codex", "Say hi in five words.", timeout=1800)
        claude = _claude(
            agent_clients, base, tmp_path / "claude", "-p", "Say hi.", "--tools", "Bash,Read", timeout=1800
        )
    assert codex.returncode == 0, codex.stderr[-2000:]
    assert claude.returncode == 0, (claude.stdout[-1000:], claude.stderr[-2000:])
    assert len(_log_lines(log_path, "/v1/responses")) == 1  # no replay
