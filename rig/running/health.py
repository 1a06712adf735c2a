"""Is the engine healthy: a one-token chat completion, since ``/v1/models`` answers 200 while the engine is dead.

Used by the supervisor while it waits, by ``nox -s status``, by the bench's first check and the
benchmarks. The profile adds its own fields to the request (e.g. ``chat_template_kwargs``).

``python3 -m rig.running.health`` is the container's health check (docker-compose.yml): the same request, to the engine
that the running rig's record (``RIG_STATE/engine.toml``) names, with its model and its profile's fields. Standard
library only, so the image's own python3 runs it: exit 0 healthy, 1 not (or not started yet).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import socket
import sys
import threading
import tomllib
from pathlib import Path

#: The running engine's record in ``RIG_STATE`` (written by rig/running/supervise.py).
ENGINE_RECORD = "engine.toml"


def connect_host(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


BODY_CAP = 1 << 20  # bytes: a one-token answer with its logprob is about 1 KB


def _exchange(conn: http.client.HTTPConnection, body: str, headers: dict, timeout: float) -> tuple[int, bytes]:
    """POST the request and read at most BODY_CAP bytes of the answer, all within ``timeout`` seconds in all: a
    timer shuts the socket at the deadline, so a server that sends a byte at a time cannot stretch the check."""
    conn.connect()
    timer = threading.Timer(timeout, lambda: conn.sock and conn.sock.shutdown(socket.SHUT_RDWR))
    timer.start()
    try:
        conn.request("POST", "/v1/chat/completions", body, headers)
        resp = conn.getresponse()
        data = resp.read(BODY_CAP + 1)
    finally:
        timer.cancel()
    if len(data) > BODY_CAP:
        raise http.client.HTTPException(f"an answer over {BODY_CAP} bytes")
    if not data and resp.status == 200:  # the deadline shut the socket while the body was still coming
        raise TimeoutError(f"no whole answer within {timeout:g} s")
    return resp.status, data


def _verdict(data: bytes) -> tuple[bool, str]:
    """A generated token whose logprob is a finite number: an engine computing NaN answers 200 all the same."""
    try:
        answer = json.loads(data)
        choices, usage = answer["choices"], answer.get("usage") or {}
    except (ValueError, KeyError, TypeError, AttributeError):
        return False, "HTTP 200 but not a chat completion"
    if not choices or usage.get("completion_tokens", 1) < 1:
        return False, "HTTP 200 but no token generated"
    try:
        logprob = choices[0]["logprobs"]["content"][0]["logprob"]
    except (KeyError, IndexError, TypeError):
        return False, "HTTP 200 but the token came without the logprob asked for"
    if not isinstance(logprob, (int, float)) or not math.isfinite(logprob):
        return False, f"the token's logprob is {logprob!r}, not a finite number: the model computes garbage"
    return True, "one token generated"


def health(host: str, port: int, model: str, api_key: str = "", timeout: float = 60.0,
           extra: dict | None = None) -> tuple[bool, str]:
    """A one-token chat completion with its logprob (and the profile's ``extra`` fields), answered within
    ``timeout`` seconds in all: (True, detail) when the engine generated a token of finite logprob."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                       "logprobs": True, **(extra or {})})
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection(connect_host(host), port, timeout=timeout)
    try:
        status, data = _exchange(conn, body, headers, timeout)
    except (OSError, http.client.HTTPException) as exc:
        return False, f"no answer ({exc.__class__.__name__}: {exc})"
    finally:
        conn.close()
    if status != 200:
        return False, f"HTTP {status}: {data[:200].decode(errors='replace').strip()}"
    return _verdict(data)


def port_open(host: str, port: int) -> bool:
    """Whether something listens there yet: the engine binds its port only once it has loaded."""
    try:
        with socket.create_connection((connect_host(host), port), timeout=0.5):
            return True
    except OSError:
        return False


def check_running(state_dir: Path, api_key: str = "", timeout: float = 30.0) -> tuple[bool, str]:
    """The one-token request to the engine the record in ``state_dir`` names (False when there is none yet)."""
    try:
        rec = tomllib.loads((state_dir / ENGINE_RECORD).read_text())
        host, port, model = rec["host"], int(rec["port"]), rec["model"]
        extra = json.loads(rec.get("health") or "{}")
    except FileNotFoundError:
        return False, f"no engine started yet (no {state_dir / ENGINE_RECORD})"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return False, f"{state_dir / ENGINE_RECORD}: unreadable ({exc})"
    ok, detail = health(host, port, model, api_key, timeout=timeout, extra=extra)
    return ok, f"{model} at {host}:{port}: {detail}"


def main(argv: list[str] | None = None) -> int:
    from rig.base import console  # only the command reads settings: the engine's callers pass their own
    from rig.facts import config

    argparse.ArgumentParser(prog="python3 -m rig.running.health",
                            description="Is the running engine healthy: a one-token "
                            "generation to the engine that RIG_STATE/engine.toml names (its model, port and profile "
                            "fields; VLLM_API_KEY as the key). Exit 0 healthy, 1 not or not started: a container's "
                            "health check.").parse_args(argv)
    s, v = config.settings(), config.serve_settings()
    ok, detail = check_running(s.state_dir, v.api_key)
    console.plain(("healthy: " if ok else "not healthy: ") + detail)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
