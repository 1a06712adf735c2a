"""A stand-in for ``vllm serve`` in the serve tests (tests only; the product never ships it).

It takes vLLM's flags, writes vLLM-format log lines (the formats of the reference), and answers
the OpenAI routes the rig and llama-benchy use: ``/v1/models``, ``/health`` and
``/v1/chat/completions`` (plain and streamed, with usage), one token per ``1 / DOUBLE_PACE`` s after a
prefill of ``prompt tokens / DOUBLE_PREFILL_PACE`` s (no prefill time when that is unset), and
``/metrics`` in Prometheus' text format with vLLM's names for the numbers the hang watchdog reads
(``vllm:num_requests_running``/``_waiting``, ``vllm:generation_tokens_total``).
``DOUBLE_*`` variables pick a misbehaviour:

* ``DOUBLE_DELAY`` seconds of "loading" before it listens (default 0.5);
* ``DOUBLE_MODE``: ``ok``; ``no-generate`` (``/v1/models`` and ``/health`` answer, generation fails);
  ``ignore-term`` (SIGTERM is ignored); ``crash`` (exits 3 while loading); ``nan`` (answers 200 with a NaN
  logprob, as a model computing NaN would if its server wrote non-finite JSON);
* ``DOUBLE_HANG_AFTER=N``: the chat completions after the first N are accepted and never answered, the
  requests stay pending and the token counter stops while ``/health`` and ``/v1/models`` answer: a hung
  EngineCore (N=1 lets the rig's one-token start check pass first);
* ``DOUBLE_CHILD=1`` starts a child that stays and ignores SIGTERM, like vLLM's EngineCore (its command line
  says ``VLLM::EngineCore`` and the checkpoint, as vLLM's renamed processes do);
* ``DOUBLE_RECORD`` is a file where it writes its argv, pid and environment as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TAG = f"(APIServer pid={os.getpid()}) "


def log(level: str, where: str, msg: str) -> None:
    sys.stdout.write(f"{TAG}{level} {time.strftime('%m-%d %H:%M:%S')} [{where}] {msg}\n")
    sys.stdout.flush()


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="vllm")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("model")
    s.add_argument("--served-model-name", nargs="+")
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key")
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--max-model-len", "--max-num-seqs",
                 "--max-num-batched-tokens", "--block-size", "--shutdown-timeout"):
        s.add_argument(flag, type=int)
    for flag in ("--kv-cache-dtype", "--speculative-config", "--compilation-config", "--gdn-prefill-backend"):
        s.add_argument(flag)
    for flag in ("--enable-expert-parallel", "--disable-custom-all-reduce", "--enforce-eager"):
        s.add_argument(flag, action="store_true")
    return p.parse_args(argv)


class State:
    busy = 0
    generated = 0
    prompt = 0
    accepted = 0  # chat completions taken, for DOUBLE_HANG_AFTER
    lock = threading.Lock()


def metrics(model: str, max_seqs: int) -> str:
    """vLLM's /metrics, cut to a few families: the three the watchdog reads, with their HELP/TYPE lines,
    vLLM's labels and the counter's _created sample, and a histogram whose names must not be mistaken for them."""
    with State.lock:
        busy, generated, prompt = State.busy, State.generated, State.prompt
    running = min(busy, max_seqs)
    labels = f'engine="0",model_name="{model}"'
    return "".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n",
        "# TYPE vllm:num_requests_running gauge\n",
        f"vllm:num_requests_running{{{labels}}} {float(running)}\n",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n",
        "# TYPE vllm:num_requests_waiting gauge\n",
        f"vllm:num_requests_waiting{{{labels}}} {float(busy - running)}\n",
        "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.\n",
        "# TYPE vllm:prompt_tokens_total counter\n",
        f"vllm:prompt_tokens_total{{{labels}}} {float(prompt)}\n",
        "# HELP vllm:generation_tokens_total Number of generation tokens processed.\n",
        "# TYPE vllm:generation_tokens_total counter\n",
        f"vllm:generation_tokens_total{{{labels}}} {float(generated)}\n",
        f"vllm:generation_tokens_created{{{labels}}} {STARTED}\n",
        "# HELP vllm:request_generation_tokens Number of generation tokens processed.\n",
        "# TYPE vllm:request_generation_tokens histogram\n",
        f'vllm:request_generation_tokens_bucket{{{labels},le="1.0"}} 1.0\n',
        f'vllm:request_generation_tokens_bucket{{{labels},le="+Inf"}} 1.0\n',
        f"vllm:request_generation_tokens_count{{{labels}}} 1.0\n",
        f"vllm:request_generation_tokens_sum{{{labels}}} {float(generated)}\n",
    ])


STARTED = time.time()


def handler_for(args: argparse.Namespace, mode: str, pace: float, prefill: float):
    names = args.served_model_name or [args.model]
    hang_after = int(os.environ["DOUBLE_HANG_AFTER"]) if os.environ.get("DOUBLE_HANG_AFTER") else None
    key = os.environ.get("VLLM_API_KEY", "") or args.api_key or ""

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # headers and body leave at once, not after the client's delayed ACK

        def log_message(self, *a) -> None:
            pass

        def _send(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": n, "object": "model"} for n in names]})
            elif self.path == "/metrics":
                body = metrics(names[0], args.max_num_seqs or 4).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if key and self.headers.get("Authorization") != f"Bearer {key}":
                return self._send(401, {"error": "Unauthorized"})
            if self.path != "/v1/chat/completions":
                return self._send(404, {"error": "not found"})
            if mode == "no-generate":
                return self._send(500, {"error": {"message": "EngineCore died", "type": "EngineDeadError"}})
            if body.get("model") not in names:
                return self._send(404, {"error": {"message": f"model {body.get('model')} does not exist"}})
            n = int(body.get("max_tokens") or 16)
            text = " ".join(m.get("content", "") for m in body.get("messages", []) if isinstance(m, dict))
            prompt = max(1, len(text.split()))
            with State.lock:
                State.busy += 1
                State.prompt += prompt
                State.accepted += 1
                hang = hang_after is not None and State.accepted > hang_after
            streamed = bool(body.get("stream"))
            finished = []

            def finish(tokens: int) -> None:
                """The request leaves the engine's counts before its answer's last bytes leave, as in vLLM (the
                engine finishes it, then the API server sends it): a sample taken once the answer is read never
                sees it pending."""
                if not finished:
                    finished.append(True)
                    with State.lock:
                        State.busy -= 1
                        State.generated += tokens

            try:
                if hang:
                    threading.Event().wait()  # never answered: pending for good, no token, like a hung EngineCore
                if prefill:
                    time.sleep(prompt / prefill)
                if streamed:
                    self._stream(body, n, prompt, finish)
                else:
                    time.sleep(n / pace)
                    finish(n)
                    logprob = float("nan") if mode == "nan" else -0.25
                    lp = {"logprobs": {"content": [{"token": " Paris", "logprob": logprob}] * n}} \
                        if body.get("logprobs") else {}
                    self._send(200, {"id": "chatcmpl-double", "object": "chat.completion", "model": body["model"],
                                     "choices": [{"index": 0, "message": {"role": "assistant",
                                                                          "content": "Paris " * n},
                                                  "finish_reason": "length", **lp}],
                                     "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                                               "total_tokens": prompt + n}})
            finally:
                finish(0)  # a failed write, say: the request is no longer pending either way

        def _stream(self, body: dict, n: int, prompt: int, finish) -> None:  # noqa: ANN001 - the closure above
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True

            def chunk(obj: dict) -> None:
                self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
                self.wfile.flush()

            base = {"id": "chatcmpl-double", "object": "chat.completion.chunk", "model": body["model"]}
            chunk({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(n):
                time.sleep(1 / pace)
                with State.lock:
                    State.generated += 1
                chunk({**base, "choices": [{"index": 0, "delta": {"content": " Paris"}, "token_ids": [i]}]})
            finish(0)  # a stream counted each token as it went
            chunk({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                chunk({**base, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": n,
                                                        "total_tokens": prompt + n}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    return H


def stats_loop(interval: float) -> None:
    last_p = last_g = 0
    while True:
        time.sleep(interval)
        with State.lock:
            p, g, busy = State.prompt, State.generated, State.busy
        if busy or p != last_p or g != last_g:
            log("INFO", "loggers.py:257", f"Engine 000: Avg prompt throughput: {(p - last_p) / interval:.1f} "
                f"tokens/s, Avg generation throughput: {(g - last_g) / interval:.1f} tokens/s, Running: {busy} "
                f"reqs, Waiting: 0 reqs, GPU KV cache usage: 1.5%, Prefix cache hit rate: 0.0%")
            log("INFO", "metrics.py:100", "SpecDecoding metrics: Mean acceptance length: 2.71, Accepted throughput: "
                "81.40 tokens/s, Drafted throughput: 142.80 tokens/s, Accepted: 814 tokens, Drafted: 1428 tokens, "
                "Per-position acceptance rate: 0.871, 0.552, 0.287, Avg Draft acceptance rate: 57.0%")
        last_p, last_g = p, g


def main() -> None:
    args = parse(sys.argv[1:])
    mode = os.environ.get("DOUBLE_MODE", "ok")
    if record := os.environ.get("DOUBLE_RECORD"):
        with open(record, "w") as fh:
            json.dump({"argv": sys.argv[1:], "pid": os.getpid(), "pgid": os.getpgid(0), "env": dict(os.environ)}, fh)
    # A plain flag, not a threading.Event: Event.set() in a signal handler deadlocks when the signal lands while
    # the main thread holds the Event's lock inside Event.wait() (two SIGTERMs at once, as a cgroup stop sends).
    stopping: list[int] = []

    def on_term(signum, _frame) -> None:
        if mode == "ignore-term":
            log("WARNING", "launcher.py:80", "SIGTERM received; this double ignores it")
            return
        stopping.append(signum)

    signal.signal(signal.SIGTERM, on_term)
    if mode == "ignore-term":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    log("INFO", "api_server.py:1200", f"vLLM API server version 0.30.0 (a test double), args: {args.model}")
    if os.environ.get("DOUBLE_CHILD") == "1":
        subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(1)",
                          "VLLM::EngineCore", args.model])
    time.sleep(float(os.environ.get("DOUBLE_DELAY", "0.5")))
    log("INFO", "default_loader.py:291", "Loading weights took 0.21 seconds")
    if mode == "crash":
        log("ERROR", "core.py:700", "EngineCore failed to start: CUDA out of memory")
        sys.exit(3)
    log("INFO", "kv_cache_utils.py:1100", "GPU KV cache size: 924,993 tokens, Maximum concurrency for 262,144 "
        "tokens per request: 3.53x")
    server = ThreadingHTTPServer((args.host or "0.0.0.0", args.port),
                                 handler_for(args, mode, float(os.environ.get("DOUBLE_PACE", "200")),
                                             float(os.environ.get("DOUBLE_PREFILL_PACE", "0"))))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    interval = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "10"))
    threading.Thread(target=stats_loop, args=(interval,), daemon=True).start()
    log("INFO", "api_server.py:1300", f"Starting vLLM API server on http://{args.host}:{args.port}")
    log("INFO", "on.py:62", "Application startup complete.")
    while not stopping:
        time.sleep(0.2)
    log("INFO", "launcher.py:110", "Shutting down FastAPI HTTP server.")
    server.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
