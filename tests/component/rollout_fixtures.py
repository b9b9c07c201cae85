"""Shared helpers and fixtures of the rollout tests: tiny random Qwen3-MoE checkpoints, engines,
SGLang contract recording, HF references and a misbehaving fake server.

Imports stay light (no transformers at import time)."""

from __future__ import annotations

import functools
import json
import shutil
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from sao_megatron.rollout import contract
from sao_megatron.rollout.launch import LocalEngines

API_KEY = "test-secret-key"
VOCAB = 128
LAYERS, TOPK = 2, 2
EOS = 1


def tiny_config(**overrides):
    from transformers import Qwen3MoeConfig

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
              num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
              num_experts_per_tok=TOPK, max_position_embeddings=256, tie_word_embeddings=False,
              eos_token_id=EOS, bos_token_id=0, rope_theta=10000.0)
    kw.update(overrides)
    return Qwen3MoeConfig(**kw)


def build_tiny_moe(out_dir: Path, seed: int, **config_overrides) -> Path:
    """A random tiny Qwen3MoeForCausalLM saved as an HF directory.

    Weights are drawn with std 0.3 (not the 0.02 init) so next-token distributions are
    peaked and position-dependent: a misaligned or stale log-prob cannot pass by accident.
    """
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_config(**config_overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out_dir)
    return out_dir


def rename_tensor(src: Path, dst: Path, old: str, new: str) -> Path:
    """Copy an HF dir with one tensor renamed (a checkpoint whose names do not match)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors[new] = tensors.pop(old)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """base (v0 weights), other (v1 weights, same architecture), bad_config, bad_names."""
    root = tmp_path_factory.mktemp("tiny-moe")
    base = build_tiny_moe(root / "base", seed=0)
    return {
        "base": base,
        "other": build_tiny_moe(root / "other", seed=1),
        "bad_config": build_tiny_moe(root / "bad_config", seed=2, rope_theta=5000.0),
        "bad_names": rename_tensor(base, root / "bad_names", "lm_head.weight", "lm_head.weights"),
    }


@functools.cache
def hf_model(model_dir: str) -> torch.nn.Module:
    """The fp32 HF reference model of a directory (loaded once per test session)."""
    from sao_megatron.rollout.engine.model import load_hf_model

    return load_hf_model(model_dir)


def hf_reference(model_dir: Path, prompt: list[int], output: list[int], sampling) -> list[float]:
    from sao_megatron.rollout.parity import hf_logprobs

    return hf_logprobs(hf_model(str(model_dir)), prompt, output, sampling)


@torch.inference_mode()
def hf_routed_experts(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), layers, topk] router top-k ids of a fresh HF forward (reference for routing replay)."""
    model = hf_model(str(model_dir))
    captured: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].mlp.gate.register_forward_hook(
        lambda _m, _i, out, i=i: captured.__setitem__(i, torch.topk(torch.softmax(out[0], -1), TOPK, -1).indices))
        for i in range(LAYERS)]
    try:
        model(input_ids=torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([captured[i] for i in range(LAYERS)], dim=1)


LOGPROB_TOL = 1e-4
"""|engine log-prob − full-forward reference| allowed, fp32 CPU: the same numbers in another order.

The engine prefills, decodes one token at a time on a KV cache beside left-padded rows, and re-prefills
after a retract; the reference is one forward without cache. Log-probs reach |lp| ≈ 10, where one fp32
ulp is 2^-20 ≈ 9.5e-7, and the two orders differ by a few to a dozen ulps: over 185 sequences of 120
tokens beside a second row with a retract and weight switch mid-sequence (100 at 1 thread, 85 at 2) the
largest gap was 1.03e-5 (the same sequence at both), the median of the per-sequence maxima 3.8e-6: the
old 1e-5 bound failed by chance. 1e-4 (~100 ulps) sits ~10x above that maximum; a log-prob from the
wrong weights, position or temperature is off by > 0.1 (wrong-version tokens: ≥ 5.7 in the same runs),
so the bound still catches such an error by a factor of ≥ 1000 (test_rollout_engine_core checks both)."""


def assert_close(actual: list[float], expected: list[float], tol: float = LOGPROB_TOL) -> None:
    assert len(actual) == len(expected)
    worst = max((abs(a - b) for a, b in zip(actual, expected)), default=0.0)
    assert worst <= tol, f"max |Δlogprob| = {worst:.3g} > {tol}: engine {actual} vs reference {expected}"


class ContractRecorder:
    """``on_exchange`` hook: validates every exchange against SGLang 0.5.23 and counts paths."""

    def __init__(self):
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []

    def __call__(self, path, payload, reply):
        self.counts[path] += 1
        try:
            contract.check_exchange(path, payload, reply)
        except contract.ContractError as exc:
            self.errors.append(str(exc))
            raise


def revived(engines: LocalEngines) -> LocalEngines:
    """The module's engines with every killed one restarted (from the model it started with).

    Failure tests kill engines; restarting them before the next test means no test has to run last.
    A restart happens only after such a test, so in file order it costs nothing.
    """
    for i in range(engines.num_engines):
        if not engines.alive(i):
            engines.restart(i)
    return engines


def reset_weights(engines: LocalEngines, model_dir: Path, *, api_key: str | None = API_KEY) -> None:
    """Every engine serves ``model_dir`` at weight version 0, as started, whatever an earlier test pushed."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for url in engines.urls:
        reply = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(model_dir), "weight_version": "0"},
                           headers=headers, timeout=120, trust_env=False).json()
        assert reply["success"], reply


def poll_until(predicate, timeout: float = 20.0, interval: float = 0.005, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not reached within {timeout} s")


class FakeEngine:
    """A loopback HTTP server that misbehaves on /generate as told: ``mode`` in
    malformed | http500 | slow | drop | wrong_lengths | ok; other paths answer 200 {}."""

    def __init__(self, mode: str, *, delay_s: float = 5.0):
        self.mode, self.delay_s = mode, delay_s
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):
                self._send(200, b"")

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                fake.handle(self, body) if self.path == "/generate" else self._send(200, b"{}")

            def _send(self, status: int, data: bytes, ctype: str = "application/json"):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that gave up (timeouts) is expected
                pass

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def handle(self, h, body):
        rid = body.get("rid", "")
        if self.mode == "malformed":
            h._send(200, b'{"text": "", "output_ids": [1, 2')
        elif self.mode == "http500":
            h._send(500, b"internal error: " + b"x" * 5000, "text/plain")
        elif self.mode == "slow":
            time.sleep(self.delay_s)
            h._send(200, b"{}")
        elif self.mode == "drop":
            h.connection.close()  # accepted, then the connection dies without a reply
        elif self.mode in ("ok", "wrong_lengths"):
            lps = [[-0.5, 7, None], [-0.25, 8, None]][: 2 if self.mode == "ok" else 1]
            reply = {"text": "", "output_ids": [7, 8], "meta_info": {
                "id": rid, "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 2,
                "completion_tokens": 2, "output_token_logprobs": lps, "weight_version": "0",
                "weight_versions": [{"version": "0", "start": 0, "end": 2}]}}
            h._send(200, json.dumps(reply).encode())

    def __enter__(self) -> FakeEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
