"""Images through a started `mtplx serve` on a tiny Qwen3.5 vision-language replica
(support.vision), driven by the real ``openai`` and ``anthropic`` clients: an image_url data URL
and an Anthropic base64 block get the reply the engine gives for the same image; a file under
--image-dir is read, one outside it and any network URL are refused; bad images, audio parts and
too many images are 400s in each API's shape."""

from __future__ import annotations

import base64

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine import Engine

import anthropic
import openai
import pytest
from support.server import KEY, running_server
from support.vision import made_up_image, write_vlm

IMAGE = made_up_image(32, 24, seed=1)
DATA_URL = "data:image/png;base64," + base64.b64encode(IMAGE).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    path = root / "hf"
    write_vlm(path, seed=3)
    images = root / "allowed"
    images.mkdir()
    (images / "cat.png").write_bytes(IMAGE)
    (root / "outside.png").write_bytes(IMAGE)
    global MODEL
    MODEL = str(path)
    with running_server(path, root / "server.log", "--image-dir", str(images)) as (base, _log):
        yield base, path, root


@pytest.fixture(scope="module")
def expected(served) -> str:
    _, path, _ = served
    engine = Engine.load(str(path))
    messages = [
        {"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": "fgh"}]}
    ]
    return engine.generate(messages, max_tokens=6, temperature=0.0).text


def _openai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)


MODEL = ""  # the served model's name: its path (set by `served`)


def _ask(client: openai.OpenAI, url: str):
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "fgh"}]
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0.0
    )


def test_openai_image_url_data_url_and_allowed_file(served, expected) -> None:
    base, _, root = served
    client = _openai(base)
    reply = _ask(client, DATA_URL)
    assert reply.choices[0].message.content == expected and reply.usage.prompt_tokens > 12
    assert _ask(client, f"file://{root / 'allowed' / 'cat.png'}").choices[0].message.content == expected
    assert _ask(client, "cat.png").choices[0].message.content == expected  # relative to --image-dir


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://example.com/cat.png", "does not fetch images over the network"),
        ("{outside}", "is outside the image directory"),
        ("{allowed}/../outside.png", "is outside the image directory"),
        ("data:image/png;base64,bm90IGFuIGltYWdl", "not a readable image"),
        ("data:image/png;base64,###", "does not decode"),
        ("cat\x00.png", "its path holds a NUL byte"),  # was a 500 (Path.resolve: embedded null byte)
    ],
)
def test_openai_bad_images_are_400s(served, url, message) -> None:
    base, _, root = served
    url = url.format(outside=root / "outside.png", allowed=root / "allowed")
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(_openai(base), url)
    assert message in caught.value.message and caught.value.body["param"] == "messages"


def test_openai_audio_parts_and_too_many_images_are_400s(served) -> None:
    base, _, _ = served
    client = _openai(base)
    audio = [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]
    with pytest.raises(openai.BadRequestError, match="input_audio parts are not supported"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": audio}], max_tokens=2
        )
    many = [{"type": "image_url", "image_url": {"url": DATA_URL}}] * 9
    with pytest.raises(openai.BadRequestError, match="9 images, over this server's limit of 8"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": many}], max_tokens=2
        )


def test_anthropic_base64_image_block(served, expected) -> None:
    base, _, _ = served
    client = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(IMAGE).decode()},
    }
    reply = client.messages.create(
        model=MODEL,
        max_tokens=6,
        messages=[{"role": "user", "content": [block, {"type": "text", "text": "fgh"}]}],
        extra_body={"temperature": 0},  # the SDK (2.x) has no sampling arguments; the API has them
    )
    assert reply.content[0].text == expected
    bad = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"},
    }
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(max_tokens=2, model=MODEL, messages=[{"role": "user", "content": [bad]}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "not a readable image" in caught.value.body["error"]["message"]
