"""A tiny OpenAI-shaped engine for cluster tests: it answers chat requests with the GPUs it was
given (CUDA_VISIBLE_DEVICES), so a test can see which devices a replica got. Standard library
only: it runs under whatever Python the agent uses."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    served = "echo"
    slots: threading.BoundedSemaphore | None = None  # --slots: answers at once, others queue
    prefill_s = 0.0  # --prefill-s: before a stream's first chunk

    def log_message(self, fmt: str, *args: object) -> None:  # quiet
        return

    def _send(self, status: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": self.served, "object": "model"}]})
        else:
            self._send(404, {"error": {"message": "not found"}})

    def _stream(self, content: str, chunks: int) -> None:
        """SSE, one chunk every 0.2 s: slow enough for a test to act mid-stream."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(chunks):
            event = {
                "id": self.reply_id,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": self.served,
                "choices": [{"index": 0, "delta": {"content": f"{content} {i}"}}],
            }
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.2)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True

    @property
    def reply_id(self) -> str:
        return f"chatcmpl-echo-{self.server.server_address[1]}"  # which replica answered

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": {"message": "not found"}})
            return
        content = f"gpus={os.environ.get('CUDA_VISIBLE_DEVICES', '')}"
        if body.get("stream"):
            if self.slots is None:
                self._stream(content, int(body.get("max_tokens") or 5))
                return
            with self.slots:  # a batch of --slots sequences: the rest wait, as in an engine
                time.sleep(self.prefill_s)
                self._stream(content, int(body.get("max_tokens") or 5))
            return
        self._send(
            200,
            {
                "id": self.reply_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.served,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            },
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--served-model", default="echo")
    ap.add_argument("--crash-if", default=None, help="exit at start while this file exists")
    ap.add_argument("--slots", type=int, default=0, help="streams answered at once (0: all)")
    ap.add_argument("--prefill-s", type=float, default=0.0, help="with --slots: before chunk 1")
    ap.add_argument("--start-s", type=float, default=0.0, help="before it listens (a model load)")
    args = ap.parse_args()
    if args.crash_if and os.path.exists(args.crash_if):
        raise SystemExit(f"echo engine: {args.crash_if} exists: crashing on start")
    Handler.served = args.served_model
    time.sleep(args.start_s)
    if args.slots > 0:
        Handler.slots = threading.BoundedSemaphore(args.slots)
        Handler.prefill_s = args.prefill_s
    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
