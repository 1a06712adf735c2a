"""Everything a run needs, checked before its first benchmark request.

BASE_URL, the tokenizer, the book, the pinned llama-benchy (and matplotlib for a sweep) and,
last, the server itself with the one-token health check of ``./start.sh``. A wrong setting is one
BadInput line and exit 2 here, rather than a llama-benchy traceback minutes into a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rig.base.console import say
from rig.base.errors import BadInput, problem
from rig.control.bench.book import book_file
from rig.control.bench.request import Request, has_book_url
from rig.control.bench.tool import ensure_installed
from rig.facts import config
from rig.running.health import health


@dataclass(frozen=True)
class Target:
    """The checked server, model, tokenizer, API key and book of one run."""

    base_url: str
    model: str
    tokenizer: Path
    api_key: str
    book: Path | None  # None: the extra arguments name their own --book-url


def _endpoint(base_url: str) -> tuple[str, int]:
    u = urlsplit(base_url)
    try:
        port = u.port or 80
    except ValueError:
        port = -1
    if u.scheme != "http" or not u.hostname or port < 0 or u.path.rstrip("/") != "/v1" or u.query:
        raise BadInput(problem("BASE_URL", "the server's OpenAI API as http://HOST:PORT/v1", repr(base_url),
                               "set BASE_URL=http://127.0.0.1:8000/v1 (or unset it: the default is built from "
                               "HOST and PORT)"))
    return u.hostname, port


def _tokenizer(path: Path) -> Path:
    fix = "set TOKENIZER to the checkpoint folder (it holds tokenizer.json) or to the tokenizer.json itself"
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        found = "a folder without tokenizer.json" if path.is_dir() else "nothing there"
        raise BadInput(problem(f"TOKENIZER {path}", "tokenizer.json, or a folder with one", found, fix))
    try:
        from tokenizers import Tokenizer  # the bench venv has it; the system Python may not
    except ImportError:
        return path  # outside the bench venv: llama-benchy reads it
    try:
        Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
        raise BadInput(problem(f"TOKENIZER {file}", "a tokenizer.json the tokenizers package reads",
                               str(exc).splitlines()[0][:200], fix)) from exc
    return path


def check(req: Request, env: dict[str, str]) -> Target:
    """Everything a run needs, checked before the first benchmark request; BadInput (exit 2) otherwise."""
    b = config.bench_settings(env)
    api_key = config.serve_settings(env).api_key
    host, port = _endpoint(b.base_url)
    tokenizer = _tokenizer(b.tokenizer)
    book = None if has_book_url(req.extra) else book_file(req, config.settings(env).cache)
    ensure_installed()
    if req.sweep:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise BadInput(problem("matplotlib", "installed (it draws the sweep plot)", "none",
                                   "run benchmarks/bench.sh (nox -s bench installs it)")) from exc
    ok, detail = health(host, port, b.model, api_key)
    if not ok:
        raise BadInput(problem(f"server {b.base_url} (model {b.model})",
                               "a one-token generation, as ./start.sh checks it", " ".join(detail.split()),
                               "start it with ./start.sh and see nox -s status; BASE_URL and MODEL name "
                               "another server or model"))
    say(f"server {b.base_url}: healthy (one token generated); model {b.model}; tokenizer {tokenizer}")
    return Target(b.base_url, b.model, tokenizer, api_key, book)
