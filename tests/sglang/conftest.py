"""Real SGLang 0.5.23 servers for the ``sglang`` tests (``pytest -m sglang``, scripts/ci_sglang.sh).

Fixture API (other test files use it; keep it stable):

- ``sglang_python``: the python of SGLang's own venv ($SAO_SGLANG_PYTHON, else what
  ``scripts/setup.sh --sglang`` prints; it builds the venv when missing).
- ``tiny_moe(variant)`` (session): directory of a tiny random Qwen3-MoE saved as safetensors, one
  per variant: ``"fp32"`` or ``"bf16"`` parameters, vocabulary :data:`VOCAB` (not a multiple of 64:
  SGLang pads embeddings to 64 rows), :data:`LAYERS` layers, top-:data:`TOPK` of 4 experts.
- ``sglang_server`` (session): ONE real server on the fp32 variant, shared by every test;
  ``sglang_server_bf16`` the same on bf16 (started only if a test asks). Both run with
  ``--enable-return-routed-experts``, ``--skip-tokenizer-init``, ``--weight-version 0`` and
  ``api_key`` :data:`API_KEY`. A :class:`Server`: ``.url``, ``.model_dir``, ``.python``,
  ``.api_key``, ``.headers``, ``.dtype``, ``.log``, ``.kill()`` (SIGKILL now), ``.restart()``
  (kill, start again from ``.model_dir`` at weight version 0; returns the new URL), ``.alive()``.
  A test that leaves the server in another state (new weights, paused, killed) must restore it
  (``restart()``) before it ends.
- ``start_sglang_server(variant, **kw)`` (function): a private server for one test, stopped after it.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from sao_megatron.rollout.launch import SGLangEngines

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sglang-test-key"
VOCAB = 250  # not a multiple of 64: SGLang pads the embedding rows, checksums must cope
LAYERS, TOPK, EXPERTS = 2, 2, 4
EOS = 1
MAX_TOTAL_TOKENS = 16384
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_tiny_moe(out_dir: Path, *, dtype: torch.dtype, seed: int = 0) -> Path:
    """A random tiny Qwen3MoeForCausalLM saved as an HF directory in ``dtype``.

    Weights drawn with std 0.3 so next-token distributions are peaked: a misaligned or stale
    log-prob cannot pass by accident."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=EXPERTS, num_experts_per_tok=TOPK, max_position_embeddings=4096,
                            tie_word_embeddings=False, eos_token_id=EOS, bos_token_id=0, rope_theta=10000.0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
    model.to(dtype).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def sglang_python() -> str:
    python = os.environ.get("SAO_SGLANG_PYTHON")
    if python:
        return python
    out = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh"), "--sglang"], check=True,
                         stdout=subprocess.PIPE, text=True, timeout=1800).stdout
    return out.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(variant: str = "fp32") -> Path:
        if variant not in made:
            made[variant] = build_tiny_moe(tmp_path_factory.mktemp(f"tiny-moe-{variant}"), dtype=DTYPES[variant])
        return made[variant]

    return get


@dataclass
class Server:
    """One real SGLang server (see the module docstring)."""

    engines: SGLangEngines
    python: str
    dtype: str
    api_key: str = API_KEY
    headers: dict[str, str] = field(default_factory=lambda: {"Authorization": f"Bearer {API_KEY}"})

    @property
    def url(self) -> str:
        return self.engines.urls[0]

    @property
    def model_dir(self) -> Path:
        return Path(self.engines.model_dir)

    @property
    def log(self) -> Path:
        return self.engines.logs[0]

    def alive(self) -> bool:
        return self.engines.alive(0)

    def kill(self) -> None:
        self.engines.kill(0)

    def restart(self) -> str:
        return self.engines.restart(0)

    def stop(self) -> None:
        self.engines.stop()


def _start(python: str, model_dir: Path, log_dir: Path, *, dtype: str, num_engines: int = 1,
           extra_args: tuple[str, ...] = (), disable: tuple[str, ...] = ()) -> SGLangEngines:
    engines = SGLangEngines(model_dir, num_engines, python=python, device="cpu", max_total_tokens=MAX_TOTAL_TOKENS,
                            api_key=API_KEY, log_dir=log_dir, startup_timeout_s=300.0,
                            extra_args=["--weight-version", "0", "--skip-tokenizer-init",
                                        "--enable-return-routed-experts", *extra_args])
    engines.disabled_patches = disable
    engines.start()
    return engines


def _session_server(request, variant: str):
    python = request.getfixturevalue("sglang_python")
    model_dir = request.getfixturevalue("tiny_moe")(variant)
    log_dir = request.getfixturevalue("tmp_path_factory").mktemp(f"sglang-{variant}-logs")
    server = Server(_start(python, model_dir, log_dir, dtype=variant), python=python, dtype=variant)
    return server


@pytest.fixture(scope="session")
def sglang_server(request):
    server = _session_server(request, "fp32")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sglang_server_bf16(request):
    server = _session_server(request, "bf16")
    yield server
    server.stop()


@pytest.fixture
def start_sglang_server(request, tmp_path):
    started: list[Server] = []

    def start(variant: str = "fp32", *, num_engines: int = 1, extra_args: tuple[str, ...] = (),
              disable: tuple[str, ...] = ()) -> Server:
        python = request.getfixturevalue("sglang_python")
        model_dir = request.getfixturevalue("tiny_moe")(variant)
        engines = _start(python, model_dir, tmp_path / f"logs{len(started)}", dtype=variant,
                         num_engines=num_engines, extra_args=extra_args, disable=disable)
        started.append(Server(engines, python=python, dtype=variant))
        return started[-1]

    yield start
    for server in started:
        server.stop()
