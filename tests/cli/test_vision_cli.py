"""`mtplx generate --image` and `mtplx inspect` on a tiny Qwen3.5 vision-language replica
(support.vision), through the real entry point (`mtplx.cli.main.main`, in process)."""

from __future__ import annotations

import io
import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine import Engine

import pytest
from support.cli import run_main
from support.vision import made_up_image, write_vlm


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm") / "hf"
    write_vlm(path, seed=3)
    (path / "cat.png").write_bytes(made_up_image(32, 24, seed=1))
    (path / "dog.png").write_bytes(made_up_image(16, 16, seed=2))
    return path


def test_generate_with_images_prints_what_the_engine_gives(checkpoint) -> None:
    cat, dog = str(checkpoint / "cat.png"), str(checkpoint / "dog.png")
    out = run_main(
        "generate",
        "--model",
        str(checkpoint),
        "--image",
        cat,
        "--image",
        dog,
        "--max-tokens",
        "6",
        "--json",
        "fgh",
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    engine = Engine.load(str(checkpoint))
    expected = engine.generate("fgh", max_tokens=6, images=[cat, dog], chat=True)
    assert got["token_ids"] == expected.token_ids and len(got["token_ids"]) > 0
    without = engine.generate("fgh", max_tokens=6, chat=True)
    assert without.token_ids != expected.token_ids  # the images were read


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--image", "/nonexistent.png"], "image 1: /nonexistent.png is not a file"),
        (["--image", "{cfg}"], "image 1: not a readable image"),
        (["--image", "{png}", "--raw"], "--image needs the chat template"),
    ],
)
def test_bad_images_are_one_line_errors(checkpoint, extra, message) -> None:
    extra = [e.format(cfg=checkpoint / "config.json", png=checkpoint / "cat.png") for e in extra]
    out = run_main("generate", "--model", str(checkpoint), "--max-tokens", "2", *extra, "fgh")
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_inspect_says_vision(checkpoint) -> None:
    out = run_main("inspect", str(checkpoint))
    assert out.returncode == 0, out.stderr
    assert "vision        images in the prompt (tower of" in out.stdout
    info = json.loads(run_main("inspect", str(checkpoint), "--json").stdout)
    assert info["vision"]["takes_images"] and info["vision"]["merge_size"] == 2


def test_chat_image_command_attaches_an_image_to_the_next_turn(checkpoint) -> None:
    from mtplx.cli.chat import ChatSettings, run_chat
    from mtplx.engine.request import GenerationRequest

    cat = str(checkpoint / "cat.png")
    engine = Engine.load(str(checkpoint))
    request = GenerationRequest.from_kwargs(max_tokens=5)
    stdin = io.StringIO(f"/image {cat}\nfgh\n/image /nonexistent.png\nijk\n")
    stdout, stderr = io.StringIO(), io.StringIO()
    assert run_chat(engine, ChatSettings(request), stdin=stdin, stdout=stdout, stderr=stderr) == 0
    first_reply = stdout.getvalue().splitlines()[0]
    with_image = [
        {"role": "user", "content": [{"type": "image", "image": cat}, {"type": "text", "text": "fgh"}]}
    ]
    assert first_reply == engine.generate(with_image, request).text
    assert "[image attached to your next turn" in stderr.getvalue()
    assert "/image: /nonexistent.png is not a file" in stderr.getvalue()
