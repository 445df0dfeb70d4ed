"""Images in server requests: OpenAI ``image_url`` content parts and Anthropic ``image`` blocks
(base64), read into bytes here and handed to the engine's vision side (`mtplx.trunk.vision`).

Where an image may come from: a ``data:image/...;base64,`` URL (OpenAI) or a base64 block
(Anthropic); a local file only under the directory the operator opted in (``serve
--image-dir``, given as ``file://`` URL or path, resolved, symlinks included, and refused
outside it). The server never fetches over the network: an ``http(s)://`` URL is a 400 saying
so. Limits (images per request, encoded bytes, decoded pixels: a decompression bomb is refused
before it is decoded) are the engine's `ImageLimits`; every refusal is one line, a 400 in the
shape of the API the route belongs to.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import unquote, urlparse

from mtplx.errors import MtplxError
from mtplx.server.openai import APIError
from mtplx.server.schemas import ImagePart, Message

from starlette.concurrency import run_in_threadpool

__all__ = ["anthropic_image_url", "check_images", "expand_images", "image_sources", "read_image_url"]

_DATA_URL = re.compile(r"^data:(image/[\w.+-]+)?(;[\w=.+-]+)*;base64,(.*)$", re.DOTALL)


def anthropic_image_url(source: dict) -> str:
    """An Anthropic image block's ``source`` as the URL an OpenAI ``image_url`` part carries."""
    kind = source.get("type")
    if kind == "base64":
        return f"data:{source.get('media_type') or 'image/png'};base64,{source.get('data', '')}"
    if kind == "url":
        return str(source.get("url", ""))
    raise APIError(
        400, f"messages: image source type {kind!r} is not supported (base64 or url)", param="messages"
    )


def _decode_data_url(url: str, max_bytes: int) -> bytes:
    found = _DATA_URL.match(url)
    if found is None:
        raise MtplxError("not a base64 data URL (data:image/...;base64,...)")
    payload = found.group(3)
    if len(payload) * 3 // 4 > max_bytes:
        raise MtplxError(f"over {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MtplxError("its base64 data does not decode") from None


def _local_file(url: str, image_dir: Path | None) -> Path:
    if image_dir is None:
        raise MtplxError(
            "local files are off on this server (send a data URL; the operator can allow a directory with --image-dir)"
        )
    raw = unquote(urlparse(url).path) if url.startswith("file://") else url
    if "\x00" in raw:  # the OS cannot take it (Path.resolve raises ValueError)
        raise MtplxError("its path holds a NUL byte")
    path = Path(raw)
    root = image_dir.resolve()
    try:
        resolved = (root / path).resolve() if not path.is_absolute() else path.resolve()
    except (OSError, RuntimeError) as err:  # a symlink loop, a name too long
        raise MtplxError(f"its path cannot be resolved ({type(err).__name__})") from None
    if not resolved.is_relative_to(root):
        raise MtplxError(f"{raw} is outside the image directory this server allows")
    return resolved


def read_image_url(url: str, image_dir: Path | None, max_bytes: int) -> bytes | str:
    """What one ``image_url`` names: the bytes of a data URL, or the path of an allowed local file
    (read by the engine, which checks its size). Raises MtplxError (the caller's 400)."""
    if url.startswith("data:"):
        return _decode_data_url(url, max_bytes)
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https", "ftp"):
        raise MtplxError("this server does not fetch images over the network (send a data URL)")
    if scheme not in ("", "file"):
        raise MtplxError(f"unsupported URL scheme {scheme!r}")
    return str(_local_file(url, image_dir))


def image_sources(messages: Sequence[Message]) -> list[str]:
    """Every image URL of the chat, in the order the template writes their placeholders."""
    return [
        part.image_url.url
        for m in messages
        if isinstance(m.content, list)
        for part in m.content
        if isinstance(part, ImagePart)
    ]


def check_images(engine, messages: Sequence[Message]) -> list[str]:
    """The chat's image URLs, or a 400 when the model takes none or there are too many. Routes call
    it before the chat template: a text-only template cannot render image parts at all."""
    urls = image_sources(messages)
    if not urls:
        return urls
    vision = engine.trunk.vision
    if vision is None:
        raise APIError(
            400, "messages: this model takes no images (its checkpoint has no vision tower)", param="messages"
        )
    if len(urls) > vision.limits.max_images:
        raise APIError(
            400,
            f"messages: {len(urls)} images, over this server's limit of {vision.limits.max_images}",
            param="messages",
        )
    return urls


async def expand_images(
    engine, messages: Sequence[Message], prompt_tokens: list[int], image_dir
) -> list[int]:
    """``prompt_tokens`` with each image placeholder expanded into its image's tokens (unchanged
    without images). A 400 for a model without a vision tower (`check_images`), a bad or
    disallowed image."""
    urls = check_images(engine, messages)
    if not urls:
        return prompt_tokens
    vision = engine.trunk.vision

    def expand() -> list[int]:
        sources = []
        for i, url in enumerate(urls):
            try:
                sources.append(read_image_url(url, image_dir, vision.limits.max_bytes))
            except MtplxError as err:
                raise MtplxError(f"image {i + 1}: {err}") from None
        return vision.expand(prompt_tokens, vision.prepare_all(sources))

    try:
        return await run_in_threadpool(expand)
    except MtplxError as err:
        raise APIError(400, f"messages: {err}", param="messages") from None
