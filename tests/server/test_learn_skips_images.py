"""`serve --learn` keeps requests with images out of the traffic log: the log holds token ids
only, so a learning round (and the idle-time sampling) would train on the prompt without its
image, another context than the one the model answered. A started server on the tiny Qwen3.5
vision-language replica (support.vision), driven by the ``openai`` client: an image request and
then a text one; only the text one is recorded."""

from __future__ import annotations

import base64
import json

import mtplx  # noqa: F401  (BLAS before mlx)

import openai
from support.server import KEY, running_server, wait_for
from support.vision import made_up_image, write_vlm

DATA_URL = "data:image/png;base64," + base64.b64encode(made_up_image(32, 24, seed=1)).decode()


def _records(learn) -> list[dict]:
    return [json.loads(p.read_bytes()) for p in sorted((learn / "traffic").glob("rec-*.json"))]


def test_serve_learn_does_not_record_a_request_with_an_image(tmp_path) -> None:
    model, learn = tmp_path / "vlm", tmp_path / "learn"
    write_vlm(model, seed=3)
    with running_server(model, tmp_path / "server.log", "--learn", str(learn)) as (base, _log):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)

        def ask(content):
            return client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": content}], max_tokens=3, temperature=0.0
            )

        with_image = ask(
            [{"type": "image_url", "image_url": {"url": DATA_URL}}, {"type": "text", "text": "fgh"}]
        )
        text_only = ask("fgh")
        # served one after the other: a recorded image request would be written before the text one
        wait_for(lambda: len(_records(learn)) >= 1)
        records = _records(learn)
    assert with_image.usage.prompt_tokens > text_only.usage.prompt_tokens  # the image reached the model
    assert [len(r["prompt"]) for r in records] == [text_only.usage.prompt_tokens], records
