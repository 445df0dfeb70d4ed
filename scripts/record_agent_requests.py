"""A recording proxy for capturing what a coding agent (Claude Code, Codex) sends to `mtplx serve`.

    python scripts/record_agent_requests.py --upstream http://127.0.0.1:8000 --port 8100 --out DIR

Every request is forwarded unchanged to ``--upstream`` (responses streamed back as they come);
each POST body is written to ``DIR/NNN-<path>.json`` (written to a temporary name, then renamed)
with its method, path and the time to the first byte of the upstream's answer. Point the agent at
the proxy's port; only 127.0.0.1 is listened on. The bodies under
``tests/server/fixtures/agents/`` were captured with it (see that folder's README).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

_HOP = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding"}


def make_app(upstream: str, out: Path) -> Starlette:
    out.mkdir(parents=True, exist_ok=True)
    counter = {"n": len(list(out.glob("*.json")))}
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(3600.0, connect=10.0))

    async def forward(request: Request):
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        started = time.monotonic()
        upstream_request = client.build_request(
            request.method, request.url.path, params=request.query_params, headers=headers, content=body
        )
        reply = await client.send(upstream_request, stream=True)
        first_byte = time.monotonic() - started
        if request.method == "POST":
            counter["n"] += 1
            name = (
                f"{counter['n']:03d}-{re.sub(r'[^a-z0-9]+', '-', request.url.path.lower()).strip('-')}.json"
            )
            record = {
                "method": request.method,
                "path": request.url.path,
                "status": reply.status_code,
                "seconds_to_first_byte": round(first_byte, 3),
                "body": json.loads(body) if body else None,
            }
            temp = out / f".{name}.tmp"
            temp.write_text(json.dumps(record, indent=1))
            os.replace(temp, out / name)

        async def stream():
            try:
                async for piece in reply.aiter_raw():
                    yield piece
            finally:
                await reply.aclose()

        kept = {k: v for k, v in reply.headers.items() if k.lower() not in _HOP | {"content-encoding"}}
        return StreamingResponse(stream(), status_code=reply.status_code, headers=kept)

    methods = ["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    uvicorn.run(make_app(args.upstream, args.out), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
