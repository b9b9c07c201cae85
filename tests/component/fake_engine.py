"""A tiny engine process speaking the SGLang API subset the supervisor and routers use (no model).

``python fake_engine.py PORT_FILE [--port P] [--weight-version V]``: binds 127.0.0.1 (port 0 = any
free port, written to PORT_FILE), answers /health, /model_info (weight_version), /server_info,
/generate (one token: the server's port modulo 100, so a test sees who served), and the disk
weight-update session (/begin_weight_update, /update_weights_from_disk, /end_weight_update), which
records the loaded path in /model_info. A real process, so SIGKILL and SIGSTOP act on it for real.

Pauses as SGLang 0.5.23 does: after /pause_generation a /generate waits until /continue_generation,
and /health (SGLang's one-token generation) answers 503 after a bound (:data:`HEALTH_BOUND_S`, SGLang's
20 s shortened) while /model_info keeps answering; /model_info reports ``paused`` so a test sees
whether the engine itself is still paused. Test hooks: ``POST /fake/stick`` makes it behave like an
SGLang whose scheduler hangs (/health 503 after the bound, /generate never answers, /model_info still
answers); ``POST /fake/deafen {"seconds": s}`` makes every request in the next ``s`` seconds lose its
connection unanswered and unserved; a /generate whose rid starts with ``drop`` loses its connection
without a reply.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HEALTH_BOUND_S = 0.5
"""How long /health waits for a generation step before answering 503 (SGLang: 20 s)."""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port_file")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--weight-version", default="0")
    args = p.parse_args()
    state = {"weight_version": args.weight_version, "model_path": "fake", "loads": 0, "paused": False,
             "stuck": False, "deaf_until": 0.0}
    lock = threading.Lock()
    resumed = threading.Condition(lock)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):  # quiet
            pass

        def _reply(self, obj, code=200):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self):
            n = int(self.headers.get("Content-Length") or 0)
            return json.loads(self.rfile.read(n) or b"{}") if n else {}

        def _deaf(self) -> bool:
            if time.monotonic() >= state["deaf_until"]:
                return False
            self.close_connection = True
            self.connection.close()
            return True

        def do_GET(self):
            if self._deaf():
                return
            port = self.server.server_address[1]
            if self.path in ("/health", "/health_generate"):
                with lock:
                    blocked = state["paused"] or state["stuck"]
                if blocked:
                    time.sleep(HEALTH_BOUND_S)
                return self._reply({}, 503 if blocked else 200)
            if self.path == "/ready":
                return self._reply({})
            if self.path in ("/model_info", "/get_model_info"):
                with lock:
                    return self._reply({"model_path": state["model_path"], "tokenizer_path": None,
                                        "is_generation": True, "weight_version": state["weight_version"],
                                        "loads": state["loads"], "port": port, "paused": state["paused"]})
            if self.path in ("/server_info", "/get_server_info"):
                return self._reply({"tp_size": 1, "dp_size": 1, "pp_size": 1, "port": port})
            self._reply({"error": "not found"}, 404)

        def do_POST(self):
            if self._deaf():
                return
            body = self._body()
            port = self.server.server_address[1]
            if self.path == "/generate":
                rid = body.get("rid", "x")
                ids = body.get("input_ids") or [0]
                if rid.startswith("drop"):
                    self.close_connection = True
                    return self.connection.close()  # accepted, then the connection dies without a reply
                with lock:
                    while state["paused"] or state["stuck"]:
                        resumed.wait()
                    v = state["weight_version"]
                return self._reply({"text": "", "output_ids": [port % 100], "meta_info": {
                    "id": rid, "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": len(ids),
                    "completion_tokens": 1, "output_token_logprobs": [[-0.5, port % 100, None]],
                    "weight_version": v, "weight_versions": [{"version": v, "start": 0, "end": 1}],
                    "served_by": port}})
            if self.path == "/update_weights_from_disk":
                with lock:
                    state.update(model_path=body["model_path"], weight_version=body.get("weight_version"),
                                 loads=state["loads"] + 1)
                return self._reply({"success": True, "message": "ok"})
            if self.path == "/fake/deafen":
                state["deaf_until"] = time.monotonic() + float(body["seconds"])
                return self._reply({"success": True})
            if self.path in ("/pause_generation", "/continue_generation", "/fake/stick"):
                with lock:
                    key, value = ("stuck", True) if self.path == "/fake/stick" else ("paused", "pause" in self.path)
                    state[key] = value
                    resumed.notify_all()
                return self._reply({"success": True})
            if self.path in ("/begin_weight_update", "/end_weight_update", "/abort_request", "/flush_cache"):
                return self._reply({"success": True})
            self._reply({"error": "not found"}, 404)

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    with open(args.port_file + ".tmp", "w") as fh:
        fh.write(str(server.server_address[1]))
    import os

    os.replace(args.port_file + ".tmp", args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
