"""Is the engine healthy: a one-token chat completion, since ``/v1/models`` answers 200 while the engine is dead.

Used by the supervisor while it waits, by ``nox -s status``, by the bench's first check and the
benchmarks. The profile adds its own fields to the request (e.g. ``chat_template_kwargs``).
"""

from __future__ import annotations

import http.client
import json
import socket


def connect_host(host: str) -> str:
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)


def health(host: str, port: int, model: str, api_key: str = "", timeout: float = 60.0,
           extra: dict | None = None) -> tuple[bool, str]:
    """A one-token chat completion (with the profile's ``extra`` fields): (True, detail) when the engine
    generated it."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                       **(extra or {})})
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn = http.client.HTTPConnection(connect_host(host), port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body, headers)
        resp = conn.getresponse()
        data = resp.read()
    except (OSError, http.client.HTTPException) as exc:
        return False, f"no answer ({exc.__class__.__name__}: {exc})"
    finally:
        conn.close()
    if resp.status != 200:
        return False, f"HTTP {resp.status}: {data[:200].decode(errors='replace').strip()}"
    try:
        choices = json.loads(data)["choices"]
        usage = json.loads(data).get("usage") or {}
    except (ValueError, KeyError, TypeError):
        return False, "HTTP 200 but not a chat completion"
    if not choices or usage.get("completion_tokens", 1) < 1:
        return False, "HTTP 200 but no token generated"
    return True, "one token generated"


def port_open(host: str, port: int) -> bool:
    """Whether something listens there yet: the engine binds its port only once it has loaded."""
    try:
        with socket.create_connection((connect_host(host), port), timeout=0.5):
            return True
    except OSError:
        return False
