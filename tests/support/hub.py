"""The Hugging Face Hub, locally: its cache layout, and a stand-in for its file API.

``cache_layout`` copies a checkpoint into huggingface_hub's cache. ``serve`` answers just what
`snapshot_download` calls: `GET /api/models/{repo}/revision/main` (the commit),
`GET /api/models/{repo}/tree/{commit}` (the file list) and `HEAD`/`GET /{repo}/resolve/{commit}/{file}`
(metadata headers, bytes); anything else is a 404 with the Hub's "repository not found" error
code. Lets tests exercise the download path (and huggingface_hub's progress bar) with no network.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

COMMIT = "1234567890abcdef1234567890abcdef12345678"


def cache_layout(src: Path, cache_dir: Path, repo_id: str, revision: str = "0" * 40) -> Path:
    """Copy a checkpoint into huggingface_hub's cache layout (blobs + snapshot symlinks +
    refs/main); returns the snapshot directory."""
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    return snap


def serve(repo_id: str, files: dict[str, bytes]) -> ThreadingHTTPServer:
    """Serve ``files`` as ``repo_id`` on a free local port, from a daemon thread; ``.shutdown()`` stops it."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool = False):
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _route(self, head: bool):
            path = urlparse(self.path).path
            api = f"/api/models/{repo_id}"
            if path in (f"{api}/revision/main", api):
                info = {"id": repo_id, "sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}
                return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
            if path.startswith(f"{api}/tree/"):
                tree = [
                    {"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                    for f, b in files.items()
                ]
                return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, head)
            prefix = f"/{repo_id}/resolve/"
            if path.startswith(prefix):
                rest = path[len(prefix) :]
                _, _, name = rest.partition("/")
                if name in files:
                    body = files[name]
                    etag = hashlib.sha1(body).hexdigest()
                    return self._send(200, body, {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"'}, head)
            self._send(
                404,
                b'{"error": "not found"}',
                {"Content-Type": "application/json", "X-Error-Code": "RepoNotFound"},
                head,
            )

        def do_GET(self):
            self._route(False)

        def do_HEAD(self):
            self._route(True)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
