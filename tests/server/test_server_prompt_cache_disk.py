"""`mtplx serve --prompt-cache-dir`: the prompt cache survives a restart (issue 42, item 2).

Real server processes (tests/support/server.py) on a tiny random MiMo checkpoint (plain
attention, its own MTP head) with the default model's tokenizer, driven by the openai client.
The reference is the first, cold answer (no cache anywhere); a restarted server must give the
same greedy tokens with ``cached_tokens`` > 0. Negative controls: a server with an adapter (a
different configuration, the same weights otherwise) reuses nothing from the directory; a
truncated file is skipped with one log line and the request is served.
"""

from __future__ import annotations

import json
from pathlib import Path

from mtplx.trunk.prompt_cache_file import verify

import httpx
import openai
import pytest
from support.server import KEY, running_server

SYSTEM = "You are a careful assistant who answers questions about caches. " * 12
REQUEST = dict(max_tokens=8, temperature=0, logprobs=True)


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory) -> Path:
    """An mlx_lm.lora adapter directory with its B matrices zero (as before training): the same
    outputs, another configuration."""
    from mtplx.checkpoints.load import load_model

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = load_model(model_dir).model
    lora = {"rank": 4, "scale": 10.0, "dropout": 0.0}
    linear_to_lora_layers(model, 1, lora)
    out = tmp_path_factory.mktemp("adapter") / "lora"
    out.mkdir()
    weights = {k: v for k, v in tree_flatten(model.parameters()) if k.endswith((".lora_a", ".lora_b"))}
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": "lora", "num_layers": 1, "lora_parameters": lora}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def _ask(base: str, model_dir: Path, question: str = "What is a prompt cache?"):
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    reply = client.chat.completions.create(model=str(model_dir), messages=messages, **REQUEST)
    tokens = [t.token for t in reply.choices[0].logprobs.content]
    return tokens, reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens


def _metric(base: str, name: str) -> float:
    response = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    for line in response.text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _entries(directory: Path) -> list[Path]:
    return [p for p in directory.glob("*.safetensors") if not p.name.startswith(".")]


def test_a_restarted_server_reuses_the_disk(model_dir, adapter_dir, tmp_path):
    cache_dir = tmp_path / "prompt-cache"
    flags = ("--depth", "2", "--prompt-cache-dir", str(cache_dir))
    with running_server(model_dir, tmp_path / "first.log", *flags) as (base, _):
        cold, cached, prompt_tokens = _ask(base, model_dir)
        assert cached == 0 and prompt_tokens > 150
    assert _entries(cache_dir), "the first server wrote nothing"
    with running_server(model_dir, tmp_path / "second.log", *flags) as (base, log):
        warm, cached, _ = _ask(base, model_dir)
        assert warm == cold
        assert cached >= prompt_tokens - 1  # the whole prompt but what must be forwarded
        assert _metric(base, "mtplx_prompt_cache_disk_hits_total") == 1
        # The one load read one whole entry the first server wrote (its size on disk, not a time).
        loaded = _metric(base, "mtplx_prompt_cache_disk_loaded_bytes_total")
        assert loaded in {path.stat().st_size for path in _entries(cache_dir)}, loaded
        _metric(
            base, "mtplx_prompt_cache_disk_load_seconds_total"
        )  # exposed (a time: its value is not asserted)
        assert _metric(base, "mtplx_prompt_cache_disk_bytes") > 0
        assert "entries" in log.read_text()


@pytest.mark.slow  # the server-level repeat of test_prompt_cache_disk's other-configuration and truncated-file tests
def test_a_restarted_server_skips_another_configurations_and_damaged_entries(
    model_dir, adapter_dir, tmp_path
):
    cache_dir = tmp_path / "prompt-cache"
    flags = ("--depth", "2", "--prompt-cache-dir", str(cache_dir))
    with running_server(model_dir, tmp_path / "first.log", *flags) as (base, _):
        cold, _, _ = _ask(base, model_dir)
    # Negative control: an adapted engine (same base weights) must not read the base's caches.
    adapted = (*flags, "--adapter-path", str(adapter_dir))
    with running_server(model_dir, tmp_path / "adapted.log", *adapted) as (base, log):
        tokens, cached, _ = _ask(base, model_dir)
        assert cached == 0 and tokens == cold  # zero B: the same output, from a full prefill
        assert _metric(base, "mtplx_prompt_cache_disk_hits_total") == 0
        assert "of another model or configuration" in log.read_text()
    # A truncated file is skipped with one log line each, and the request is served.
    truncated = _entries(cache_dir)
    for path in truncated:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 3])
    with running_server(model_dir, tmp_path / "truncated.log", *flags) as (base, log):
        tokens, cached, _ = _ask(base, model_dir)
        assert tokens == cold and cached == 0
        skipped = [line for line in log.read_text().splitlines() if "skipped" in line and "damaged" in line]
        assert len(skipped) == len(truncated) >= 1, skipped


def test_sigterm_after_a_long_reply_keeps_it_and_a_second_server_is_refused(model_dir, tmp_path):
    """Issue 49 items 4 and 5: SIGTERM right after a long reply drains the queued write (the log
    says how many entries were written and dropped) and a restart reuses the whole conversation;
    a second server on the same directory is refused in one line while the first holds it."""
    import subprocess
    import sys

    from support.paths import REPO

    cache_dir = tmp_path / "prompt-cache"
    # The head drafts every cycle: a row whose cycles the lookup drafter took ends with the head's
    # cache at the prompt, and its final entry holds the prompt alone (whatever the shutdown does).
    flags = ("--depth", "2", "--draft", "head", "--prompt-cache-dir", str(cache_dir))
    messages = [{"role": "user", "content": "Tell me a long story."}]  # the model's context: 256
    with running_server(model_dir, tmp_path / "first.log", *flags) as (base, first_log):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=300)
        reply = client.chat.completions.create(
            model=str(model_dir), messages=messages, max_tokens=150, temperature=0
        )
        assert reply.usage.completion_tokens == 150
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "mtplx",
                "serve",
                "--model",
                str(model_dir),
                "--port",
                base.rsplit(":", 1)[1],
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
        )
        lines = [line for line in second.stderr.splitlines() if line.startswith("mtplx: error")]
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr
        assert len(lines) == 1 and "in use by another process" in lines[0] and str(cache_dir) in lines[0]
    # running_server sent SIGTERM as soon as the reply was in.
    shutdown = [line for line in first_log.read_text().splitlines() if "shutdown" in line]
    assert len(shutdown) == 1 and "0 dropped" in shutdown[0], shutdown
    # The request's final entry reached the disk before the process ended, sound. (What it holds is
    # the positions its caches held at the end: the reply too in some runs, the prompt alone in others;
    # see the report of issue 49 item 4.)
    sizes = []
    for path in _entries(cache_dir):
        data = path.read_bytes()
        header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
        sizes.append(int(header["__metadata__"]["0.mtplx_size"]))
    assert sizes and max(sizes) >= reply.usage.prompt_tokens - 1, (sizes, reply.usage.prompt_tokens)
    for path in _entries(cache_dir):
        verify(path)
