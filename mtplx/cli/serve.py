"""`mtplx serve`: flags and start-up; the app is `mtplx.server.app`.

The model, sampling and drafting flags are `generate`'s (`mtplx.cli.args`); on `serve` the
sampling and drafting ones are the defaults for the fields a request omits (OpenAI's sampler
defaults when not given), as in `mlx_lm.server`.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from dataclasses import replace

from mtplx.cli.args import (
    add_disk_cache_args,
    add_drafting_args,
    add_model_args,
    add_sampling_args,
    check_disk_cache_args,
    check_model_spec,
    disk_cache_bytes,
    load_engine,
    request_from_args,
)
from mtplx.cli.signals import terminate_as_exit
from mtplx.errors import MtplxError
from mtplx.learn.config import DEFAULT_LEARN_CONFIG
from mtplx.sample.params import SamplerConfig
from mtplx.server.settings import ServerSettings
from mtplx.spec_decode.settings import DEFAULT_PREFILL_STEP

__all__ = ["HELP", "add_args", "run", "serve"]

HELP = "an OpenAI-compatible HTTP server (chat and text completions)"


log = logging.getLogger("mtplx.server")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    engine,
    settings: ServerSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
) -> None:
    """Serve ``engine`` until interrupted (blocks)."""
    try:
        from mtplx.server.app import create_app
        from mtplx.server.worker import GenerationWorker

        import uvicorn
    except ModuleNotFoundError as err:
        if (err.name or "mtplx").startswith("mtplx"):
            raise  # a bug of ours, not a missing extra
        raise MtplxError(
            f"serve: needs the server extra ({err.name} is missing): pip install 'mtplx[serve]'"
        ) from None

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="mtplx: %(message)s")
    if not _is_loopback(host) and settings.api_key is None:
        log.warning("WARNING: listening on %s without an API key: anyone who can reach it can use it", host)
    if settings.prompt_cache_dir is not None:  # indexes what is there now: requests reuse it from the first
        engine.use_disk_cache(settings.prompt_cache_dir, settings.prompt_cache_disk_bytes)
    learner = _learner(engine, settings) if settings.learn_dir is not None else None
    worker = GenerationWorker(
        engine,
        settings.max_queue,
        settings.decode_concurrency,
        settings.prompt_concurrency,
        settings.draft_policy,
        settings.prefill_step_size,
        learner=learner,
    )
    app = create_app(worker, settings)
    worker.start()
    log.info("serving %s on http://%s:%d/v1", settings.model_id, host, port)
    # uvicorn raises SIGTERM again once it has shut down, under the handler it found: with this one
    # the ``finally`` runs, and the prompt-cache writes still queued reach the disk (bounded).
    with terminate_as_exit():
        try:
            uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)
        finally:
            worker.stop()


def _learner(engine, settings: ServerSettings):
    """`--learn`'s hook on the worker (`mtplx.learn.serving.Learner`), its rounds as the flags set them."""
    from mtplx.learn.log import DEFAULT_LOG_BYTES
    from mtplx.learn.serving import Learner

    cfg = DEFAULT_LEARN_CONFIG
    if settings.learn_every is not None:
        cfg = replace(cfg, min_records=settings.learn_every, new_records=settings.learn_every)
    if settings.learn_steps is not None:
        cfg = replace(cfg, steps=settings.learn_steps)
    if settings.learn_samples is not None:
        cfg = replace(cfg, samples=settings.learn_samples)
    learner = Learner(engine, settings.learn_dir, settings.learn_max_bytes or DEFAULT_LOG_BYTES, cfg)
    log.info("--learn: recording finished requests (token ids) in %s", learner.log.dir)
    return learner


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    # Defaults for the fields a request omits; OpenAI's sampler defaults unless given.
    add_sampling_args(parser, SamplerConfig())
    add_drafting_args(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 (default: $MTPLX_API_KEY)"
    )
    parser.add_argument(
        "--prompt-cache-bytes",
        type=int,
        default=None,
        help="bytes of caches kept for prompt reuse across requests (default 2 GiB; 0 turns it off)",
    )
    add_disk_cache_args(parser)
    _add_batch_args(parser)
    _add_request_limit_args(parser)
    _add_learn_args(parser)


def _add_batch_args(parser: argparse.ArgumentParser) -> None:
    """The queue and the batch: how many requests wait, decode and prefill together, and how they draft."""
    parser.add_argument("--max-queue", type=int, default=64, help="requests waiting before 429 (default 64)")
    parser.add_argument(
        "--decode-concurrency",
        type=int,
        default=32,
        help="requests decoded together in one batch (default 32; 1 serves one at a time)",
    )
    parser.add_argument(
        "--prompt-concurrency",
        type=int,
        default=8,
        help="requests prefilled meanwhile, a chunk per cycle (default 8)",
    )
    parser.add_argument(
        "--prefill-step-size",
        type=int,
        default=DEFAULT_PREFILL_STEP,
        help="prompt tokens forwarded per cycle, all prefilling requests together: what a long prompt "
        f"stalls the running streams by (default {DEFAULT_PREFILL_STEP})",
    )
    parser.add_argument(
        "--draft-policy",
        choices=("auto", "fixed"),
        default="auto",
        help="batched draft lengths: 'auto' drafts where the measured cost says it pays (plain "
        "batched AR is the floor), 'fixed' drafts every request's depth every cycle, and a prompt-lookup row its whole match, "
        "for tests and benchmarks (default auto)",
    )


def _add_request_limit_args(parser: argparse.ArgumentParser) -> None:
    """What one request may ask for and how long it may take; names, keep-alives, bodies, origins, images."""
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds per request (default 600)"
    )
    parser.add_argument("--max-tokens-cap", type=int, default=8192, help="largest max_tokens accepted")
    parser.add_argument(
        "--responses-max-tokens",
        type=int,
        default=4096,
        help="max_output_tokens of a /v1/responses request that sends none, as Codex does "
        "(default 4096; never more than the context leaves or --max-tokens-cap)",
    )
    parser.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        metavar="NAME",
        help="a name requests may ask for (repeat for aliases; the first is reported); "
        "default: any model name is served by the loaded model",
    )
    parser.add_argument(
        "--keepalive-interval",
        type=float,
        default=5.0,
        help="seconds without an event after which a stream sends a keep-alive (default 5)",
    )
    parser.add_argument("--max-body-bytes", type=int, default=10 * 1024 * 1024, help="request body limit")
    parser.add_argument(
        "--allowed-origins", default=None, help="comma-separated CORS origins (default: CORS off)"
    )
    parser.add_argument(
        "--image-dir",
        default=None,
        metavar="DIR",
        help="local image files requests may name (file:// or path) must lie under DIR (default: data URLs only)",
    )


def _add_learn_args(parser: argparse.ArgumentParser) -> None:
    """`--learn DIR` and its round settings (README: Learning from traffic)."""
    parser.add_argument(
        "--learn",
        default=None,
        metavar="DIR",
        help="record each finished request's prompt and completion token ids in DIR (user text, as token "
        "ids; 0600 files) and train the head on them between requests, swapping in heads that measure "
        'better (README: Learning from traffic); a request opts out with "mtplx": {"learn": false} '
        "or the header X-Mtplx-Learn: 0",
    )
    parser.add_argument(
        "--learn-max-bytes",
        type=int,
        default=None,
        help="bytes the traffic log of --learn may hold, oldest records removed first (default 256 MiB)",
    )
    parser.add_argument(
        "--learn-every",
        type=int,
        default=None,
        help=f"--learn: new requests between two learning rounds (default {DEFAULT_LEARN_CONFIG.new_records})",
    )
    parser.add_argument(
        "--learn-steps",
        type=int,
        default=None,
        help=f"--learn: training steps per learning round (default {DEFAULT_LEARN_CONFIG.steps})",
    )
    parser.add_argument(
        "--learn-samples",
        type=int,
        default=None,
        help="--learn: answers the model samples to each logged request while idle, trained on too (kept "
        f"in memory, never on disk; default {DEFAULT_LEARN_CONFIG.samples})",
    )


def _image_dir(value: str | None):
    from pathlib import Path

    if value is None:
        return None
    if not Path(value).is_dir():
        raise MtplxError(f"--image-dir: {value} is not a directory")
    return Path(value).resolve()


def _check_server_flags(args: argparse.Namespace) -> None:
    for name in (
        "port",
        "max_queue",
        "max_tokens_cap",
        "max_body_bytes",
        "decode_concurrency",
        "prompt_concurrency",
        "prefill_step_size",
        "responses_max_tokens",
    ):
        if getattr(args, name) <= 0:
            raise MtplxError(f"--{name.replace('_', '-')}: must be > 0, got {getattr(args, name)}")
    if args.port > 65535:
        raise MtplxError(f"--port: must be <= 65535, got {args.port}")
    for name in ("request_timeout", "keepalive_interval"):
        if getattr(args, name) <= 0:
            raise MtplxError(f"--{name.replace('_', '-')}: must be > 0, got {getattr(args, name)}")
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        raise MtplxError("--served-model-name: must not be empty")
    for name in ("learn_max_bytes", "learn_every", "learn_steps"):
        flag, value = "--" + name.replace("_", "-"), getattr(args, name)
        if value is not None and args.learn is None:
            raise MtplxError(f"{flag}: needs --learn")
        if value is not None and value <= 0:
            raise MtplxError(f"{flag}: must be > 0, got {value}")
    if args.learn_samples is not None:
        if args.learn is None:
            raise MtplxError("--learn-samples: needs --learn")
        if args.learn_samples < 0:
            raise MtplxError(f"--learn-samples: must be >= 0, got {args.learn_samples}")
    if args.learn is not None and not args.learn.strip():
        raise MtplxError("--learn: empty path (name a directory)")
    if args.prompt_cache_bytes is not None and args.prompt_cache_bytes < 0:
        raise MtplxError(f"--prompt-cache-bytes: must be >= 0, got {args.prompt_cache_bytes}")
    check_disk_cache_args(args)


def run(args: argparse.Namespace) -> int:
    _check_server_flags(args)
    defaults = request_from_args(args)  # before loading (and importing MLX): a typo costs no load time
    check_model_spec(args.model)
    from mtplx.checkpoints import load as loading
    from mtplx.trunk.prompt_cache import DEFAULT_PROMPT_CACHE_BYTES

    cache_bytes = DEFAULT_PROMPT_CACHE_BYTES if args.prompt_cache_bytes is None else args.prompt_cache_bytes
    api_key = args.api_key if args.api_key is not None else os.environ.get("MTPLX_API_KEY") or None
    origins = tuple(o.strip() for o in (args.allowed_origins or "").split(",") if o.strip())
    engine = load_engine(args, prompt_cache_bytes=cache_bytes)
    served = tuple(args.served_model_name or ())
    # The id replies report: the first --served-model-name, else the model as given, else the default's name.
    model_id = served[0] if served else args.model if args.model is not None else loading.DEFAULT_MODEL_NAME
    settings = ServerSettings(
        model_id=model_id,
        served_names=served,
        keepalive_interval=args.keepalive_interval,
        responses_default_max_tokens=args.responses_max_tokens,
        defaults=defaults,
        api_key=api_key,
        max_queue=args.max_queue,
        decode_concurrency=args.decode_concurrency,
        prompt_concurrency=args.prompt_concurrency,
        prefill_step_size=args.prefill_step_size,
        draft_policy=args.draft_policy,
        request_timeout=args.request_timeout,
        max_tokens_cap=args.max_tokens_cap,
        max_body_bytes=args.max_body_bytes,
        allowed_origins=origins,
        prompt_cache_dir=args.prompt_cache_dir,
        prompt_cache_disk_bytes=disk_cache_bytes(args),
        image_dir=_image_dir(args.image_dir),
        learn_dir=args.learn,
        learn_max_bytes=args.learn_max_bytes,
        learn_every=args.learn_every,
        learn_steps=args.learn_steps,
        learn_samples=args.learn_samples,
    )
    serve(engine, settings, host=args.host, port=args.port)
    return 0
