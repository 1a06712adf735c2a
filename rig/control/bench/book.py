"""The book text prompts are cut from, and the loopback HTTP server that hands it to llama-benchy.

llama-benchy 0.4.0 only fetches its book over http (``--book-url``), so a local file, or the prose
the rig generates into RIG_CACHE (no network needed), is served on 127.0.0.1 for one run. It
caches every fetched URL under ``~/.cache/llama-benchy``; that copy is removed when the run ends.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rig.base import prose
from rig.base.errors import BadInput, problem
from rig.control.bench.request import BOOK_NAME, Request


def book_file(req: Request, cache: Path) -> Path:
    """The book text: --book-file, or prose the rig generates into RIG_CACHE (no network needed)."""
    if req.book is not None:
        path = req.book
        fix = "pass --book-file with a plain UTF-8 text file (any long text works; a short one is repeated)"
    else:
        path = prose.ensure(cache / BOOK_NAME)
        fix = f"remove {path} (it is made again), or pass --book-file FILE"
    if not path.is_file() or path.stat().st_size == 0:
        found = "an empty file" if path.is_file() else "nothing there"
        raise BadInput(problem(f"book text {path}", "a plain UTF-8 text file", found, fix))
    try:
        path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(problem(f"book text {path}", "UTF-8 text", f"undecodable bytes ({exc.reason})", fix)) from exc
    return path


@contextmanager
def serve_book(path: Path) -> Iterator[str]:
    """Serve ``path`` at a loopback URL while the block runs; remove llama-benchy's cached copy after."""
    data = path.read_bytes()
    name = f"/book-{hashlib.sha256(data).hexdigest()[:16]}.txt"

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if self.path != name:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}{name}"
    try:
        yield url
    finally:
        srv.shutdown()
        srv.server_close()
        # llama-benchy 0.4.0 keeps every fetched URL as ~/.cache/llama-benchy/<md5 of the URL>.txt
        cached = Path.home() / ".cache" / "llama-benchy" / f"{hashlib.md5(url.encode()).hexdigest()}.txt"
        cached.unlink(missing_ok=True)
