"""`sao-megatron serve-local --model-dir D --port P`: the embedded CPU engine speaking SGLang's native API."""

from __future__ import annotations

import argparse
import logging
import socket
from pathlib import Path

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-local", help="serve an HF model on CPU with SGLang's native HTTP API (embedded engine)")
    p.add_argument("--model-dir", required=True, help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--port", type=int, required=True, help="port to listen on (0: any free port, see --port-file)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port-file", default=None, help="write the bound port here once listening (for --port 0)")
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="token-in/token-out only: no tokenizer, text prompts refused (as SGLang)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (health probes exempt)")
    p.add_argument("--weight-version", default="0", help="initial weight version reported in replies")
    p.add_argument("--max-running-requests", type=int, default=32, help="requests decoded together at most")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per request: hash of seed and rid)")
    p.add_argument("--logprob-mode", choices=["sglang", "original", "sampled"], default="sglang",
                   help="which log-prob to report (see sao_megatron/rollout/engine/sampling.py)")
    p.add_argument("--enable-return-routed-experts", action="store_true",
                   help="allow return_routed_experts (MoE router top-k ids per layer)")
    p.add_argument("--served-model-name", default=None, help="name reported by /model_info (default: model dir)")
    p.add_argument("--weight-update-timeout-s", type=float, default=300.0,
                   help="bound on every rendezvous and receive of a weight-update group (a dead sender fails it)")
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads")
    p.set_defaults(func=run)


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn's ``sockets=``.

    The protocol must be named: asyncio disables Nagle only on connections whose ``proto`` is
    IPPROTO_TCP, and with Nagle on, every keep-alive reply with a body waits ~40 ms for the
    client's delayed ACK (each weight-update call, each /generate).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def run(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from sao_megatron.rollout.engine.core import EngineCore
    from sao_megatron.rollout.engine.model import ModelRunner
    from sao_megatron.rollout.engine.server import EngineServer

    if args.max_running_requests < 1:
        raise ValueError("--max-running-requests must be >= 1")
    torch.set_num_threads(args.num_threads)
    from sao_megatron.rollout.engine.batching import load_tokenizer

    tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args.model_dir)
    runner = ModelRunner(args.model_dir)
    core = EngineCore(runner, weight_version=args.weight_version, max_running=args.max_running_requests,
                      seed=args.seed, logprob_mode=args.logprob_mode)
    core.start()
    # Bind first (port 0 = a free port chosen by the OS, no race), then report it.
    sock = listen_socket(args.host, args.port)
    port = sock.getsockname()[1]
    app = EngineServer(core, api_key=args.api_key, host=args.host, port=port,
                       enable_routed_experts=args.enable_return_routed_experts,
                       served_model_name=args.served_model_name,
                       weight_update_timeout_s=args.weight_update_timeout_s, tokenizer=tokenizer).app()
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)
    logger.info("embedded engine serving %s on http://%s:%d (weight version %s)",
                args.model_dir, args.host, port, args.weight_version)
    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=75, timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        core.stop()
    return 0
