"""The GPU path, checked without a GPU (issue 13): tensors land on the training device, collectives
use device tensors, fp16 scaler skips are not failures, the device setting is honoured, engine
health tells busy from dead.

CUDA is not available here, so "the device" is the ``meta`` device: a tensor built for the model
on the CPU instead of on ``ctx.device`` shows up as a CPU tensor, exactly as it would next to CUDA
weights. Each test failed on the code before the fix (CPU tensors, a CPU all-reduce, scaler skips
counted as NaN steps, a CPU value head, no ``resources.device``, a 5 s /health bound)."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import pytest
import torch

from sao_megatron.scheduler.sample import Sample

pytestmark = pytest.mark.unit
META = torch.device("meta")


def samples(n: int = 6, vocab: int = 50) -> list[Sample]:
    out = []
    for i in range(n):
        resp = list(range(3, 3 + 2 + i))
        mask = [1] * len(resp)
        if len(resp) > 3:
            mask[1] = 0
        out.append(Sample(prompt_ids=[1, 2], response_ids=resp, action_mask=mask,
                          rollout_logprobs=[-1.0 if m else 0.0 for m in mask], versions=[0] * len(resp),
                          reward=float(i % 2), index=i, group_id=i))
    return out


# ---------------------------------------------------------------- 1. batches on the device


@pytest.mark.parametrize("dp_rank,dp_size", [(0, 1), (1, 2)])
def test_prepare_batch_puts_every_microbatch_tensor_on_the_device(dp_rank, dp_size):
    from sao_megatron.training.step.batch import prepare_batch

    batch = prepare_batch(samples(), dp_rank=dp_rank, dp_size=dp_size, pad_multiple=2, max_tokens=16,
                          vocab_size=50, device=META)
    assert batch.microbatches and batch.device == META
    for mb in batch.microbatches:
        for name, t in mb.items():
            assert t.device == META, f"{name} built on {t.device}"
            assert name == "row" or t.shape[1] % 2 == 0
    assert batch.num_tokens == sum(sum(s.action_mask) for s in samples())
    # meta tensors hold no values: the same batch on the CPU says which rows this rank got
    cpu = prepare_batch(samples(), dp_rank=dp_rank, dp_size=dp_size, pad_multiple=2, max_tokens=16,
                        vocab_size=50, device="cpu")
    rows = sorted(int(r) for mb in cpu.microbatches for r in mb["row"])
    longest_first = [5, 4, 3, 2, 1, 0]  # sample i has i + 2 response tokens
    assert rows == sorted(longest_first[dp_rank::dp_size])


def test_outcome_advantages_follow_the_batch_device():
    from sao_megatron.config import AlgorithmConfig
    from sao_megatron.training.step import rl_step
    from sao_megatron.training.step.batch import prepare_batch

    batch = prepare_batch(samples(8), dp_rank=0, dp_size=1, pad_multiple=1, max_tokens=64, vocab_size=50,
                          device=META)
    adv = rl_step.outcome_advantages(batch, AlgorithmConfig(name="grpo_dis", group_size=2), None)
    assert adv.device == META and adv.shape == (8,)


class _SeenDevice(Exception):
    def __init__(self, device):
        super().__init__(str(device))
        self.device = device


def test_optimizer_step_reduces_a_tensor_on_ctx_device(monkeypatch):
    """NCCL reduces device tensors only: the loss/finite status must be built on ctx.device."""
    from sao_megatron.training.step import optim

    def all_reduce(t, *a, **k):
        raise _SeenDevice(t.device)

    monkeypatch.setattr(optim, "forward_backward", lambda *a, **k: [{"loss": torch.tensor(0.5)}])
    monkeypatch.setattr(optim.dist, "all_reduce", all_reduce)
    chunk = SimpleNamespace(train=lambda: None, zero_grad_buffer=lambda: None)
    opt = SimpleNamespace(zero_grad=lambda: None, param_groups=[{"lr": 1.0}])
    ctx = SimpleNamespace(device=META, tp_size=1)
    with pytest.raises(_SeenDevice) as seen:
        optim.optimizer_step([chunk], opt, None, [{}], None, ctx=ctx)
    assert seen.value.device == META


# ---------------------------------------------------------------- 2. fp16 loss-scaler skips


class _FakeOptimizer:
    def __init__(self, scaler: bool, outcome):
        self.grad_scaler = object() if scaler else None
        self.outcome, self.param_groups, self.stepped = outcome, [{"lr": 1e-3}], 0

    def zero_grad(self):
        pass

    def step(self):
        self.stepped += 1
        return self.outcome


def _step(monkeypatch, optimizer, loss: float):
    from sao_megatron.training.step import optim

    monkeypatch.setattr(optim, "forward_backward", lambda *a, **k: [{"loss": torch.tensor(loss)}])
    monkeypatch.setattr(optim.dist, "all_reduce", lambda t, *a, **k: None)
    chunk = SimpleNamespace(train=lambda: None, zero_grad_buffer=lambda: None)
    sched = SimpleNamespace(step=lambda increment: None)
    return optim.optimizer_step([chunk], optimizer, sched, [{}], None, ctx=SimpleNamespace(device="cpu", tp_size=1))


def test_scaler_skips_are_not_non_finite_steps(monkeypatch):
    from sao_megatron.training.step.optim import NonFiniteGuard

    guard = NonFiniteGuard(max_steps=3)
    for step in range(6):  # Megatron's dynamic scaler starts at 2**32: the first steps overflow by design
        result = _step(monkeypatch, _FakeOptimizer(scaler=True, outcome=(False, None, None)), loss=0.7)
        assert not result.applied and result.scaler_skip
        guard.record(result, step)
    assert guard.streak == 0


def test_real_non_finite_steps_still_stop_the_run(monkeypatch):
    from sao_megatron.training.step.optim import NonFiniteGuard, NonFiniteLossError

    guard = NonFiniteGuard(max_steps=3)
    nan_loss = _step(monkeypatch, _FakeOptimizer(scaler=True, outcome=(True, 1.0, None)), loss=math.nan)
    assert not nan_loss.applied and not nan_loss.scaler_skip
    bf16_overflow = _step(monkeypatch, _FakeOptimizer(scaler=False, outcome=(False, None, None)), loss=0.5)
    assert not bf16_overflow.scaler_skip  # without a scaler a failed step is a real failure
    guard.record(nan_loss, 0)
    guard.record(bf16_overflow, 1)
    with pytest.raises(NonFiniteLossError, match="run.max_nan_steps"):
        guard.record(nan_loss, 2)


def test_chained_optimizer_scaler_is_found():
    from sao_megatron.training.step.optim import uses_loss_scaler

    chained = SimpleNamespace(chained_optimizers=[_FakeOptimizer(False, None), _FakeOptimizer(True, None)])
    assert uses_loss_scaler(chained) and not uses_loss_scaler(_FakeOptimizer(False, None))


# ---------------------------------------------------------------- 3. modules built outside Megatron's layers


def test_value_head_and_local_norm_are_created_on_the_init_device(monkeypatch):
    from sao_megatron.models import critic, specs

    monkeypatch.setattr(specs, "init_device", lambda config: META)
    config = SimpleNamespace(hidden_size=8, sequence_parallel=False, params_dtype=torch.float32,
                             normalization="RMSNorm")
    gpt = SimpleNamespace(config=config, output_layer=None)
    head = critic.attach_value_head(gpt, tp_group=None)
    assert {p.device for p in head.parameters()} == {META}
    norm = specs.LocalNorm(config=config, hidden_size=8, eps=1e-6)
    assert {p.device for p in norm.parameters()} == {META}


def test_init_device_follows_megatron_use_cpu_initialization(monkeypatch):
    from sao_megatron.models.specs import init_device

    assert init_device(SimpleNamespace(use_cpu_initialization=True)) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert init_device(SimpleNamespace(use_cpu_initialization=False)) == torch.device("cuda", 3)


def test_init_device_follows_a_meta_build():
    """Failed before: a parameter-counting build under torch.device("meta") allocated our norms and the DSA
    indexer's projections on the CPU (megatron's own layers take the default device)."""
    from sao_megatron.models.specs import init_device

    with torch.device("meta"):
        assert init_device(SimpleNamespace(use_cpu_initialization=True)) == META


def test_a_parameter_off_the_device_is_a_clear_error():
    from sao_megatron.models.builder import check_on_device

    chunk = torch.nn.Linear(2, 2)
    check_on_device([chunk], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="parameter weight is on cpu, the model belongs on meta"):
        check_on_device([chunk], META)


def test_a_buffer_off_the_device_is_an_error_too():
    """Failed before: buffers off the device were only logged."""
    from sao_megatron.models.builder import check_on_device

    with torch.device("meta"):
        chunk = torch.nn.Linear(2, 2)
    chunk.register_buffer("expert_bias", torch.zeros(2))
    with pytest.raises(RuntimeError, match="buffer expert_bias is on cpu, the model belongs on meta"):
        check_on_device([chunk], META)
    check_on_device([chunk], META, buffers=False)  # a meta (parameter-counting) build checks parameters only


def test_the_device_index_counts():
    """Failed before: only the device type was compared, so cuda:1 passed for cuda:0 (a stub chunk: no GPU)."""
    from sao_megatron.models.builder import check_on_device

    on_gpu1 = SimpleNamespace(device=torch.device("cuda", 1))
    chunk = SimpleNamespace(named_parameters=lambda: [("w", on_gpu1)], named_buffers=lambda: [])
    check_on_device([chunk], torch.device("cuda", 1))
    with pytest.raises(RuntimeError, match="parameter w is on cuda:1, the model belongs on cuda:0"):
        check_on_device([chunk], torch.device("cuda", 0))


def test_place_on_device_moves_parameters_and_buffers_and_keeps_megatron_tags():
    """CPU -> meta converts by new Parameters (torch cannot set ``.data`` across): the tags come along."""
    from sao_megatron.models.builder import check_on_device, place_on_device

    chunk = torch.nn.Linear(2, 2)
    chunk.weight.tensor_model_parallel, chunk.weight.partition_dim = True, 0
    chunk.register_buffer("expert_bias", torch.zeros(2))
    assert place_on_device([chunk], META) == META
    check_on_device([chunk], META)
    assert (chunk.weight.tensor_model_parallel, chunk.weight.partition_dim) == (True, 0)
    assert not hasattr(chunk.bias, "partition_dim")


# ---------------------------------------------------------------- 4. resources.device


def test_device_cuda_without_cuda_stops_with_the_reason():
    from sao_megatron.parallel.bootstrap import DeviceError, resolve_device

    with pytest.raises(DeviceError, match="resources.device=cuda but CUDA is unusable here: .*resources.device=cpu"):
        resolve_device("cuda", 0)


def test_device_auto_falls_back_with_one_warning_line(caplog):
    from sao_megatron.parallel.bootstrap import resolve_device

    with caplog.at_level(logging.WARNING):
        assert resolve_device("auto", 0) == torch.device("cpu")
    lines = [r for r in caplog.records if "resources.device=auto" in r.getMessage()]
    assert len(lines) == 1 and "trains on the CPU" in lines[0].getMessage()


def test_device_cpu_never_probes_cuda(monkeypatch):
    from sao_megatron.parallel.bootstrap import resolve_device

    def boom():
        raise AssertionError("probed CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    assert resolve_device("cpu", 0) == torch.device("cpu")


def test_cuda_problem_names_a_missing_device(monkeypatch):
    from sao_megatron.parallel import bootstrap

    monkeypatch.setattr(bootstrap.torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert bootstrap.cuda_problem(1) is None
    assert "local rank 2 but only 2 GPU(s) visible" in bootstrap.cuda_problem(2)


def test_config_validation_never_probes_cuda_and_layouts_say_where_they_run(monkeypatch):
    import pathlib

    from sao_megatron.config import load_config

    def boom():
        raise AssertionError("config validation probed CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    root = pathlib.Path(__file__).resolve().parents[2] / "configs" / "experiments"
    cpu = sorted(root.glob("*cpu*.yaml"))
    gpu = sorted(set(root.glob("*.yaml")) - set(cpu))
    assert root / "tiny_cpu.yaml" in cpu and gpu
    assert {p.name: load_config(p).resources.device for p in cpu} == {p.name: "cpu" for p in cpu}
    assert {p.name: load_config(p).resources.device for p in gpu} == {p.name: "cuda" for p in gpu}


# ---------------------------------------------------------------- 5. health: busy is not dead


class _Engine:
    """/model_info answers at once; /health answers after ``health_delay_s`` (SGLang runs a generation)."""

    def __init__(self, health_delay_s: float, health_status: int = 200):
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/health":
                    time.sleep(engine.health_delay_s)
                    self._send(health_status)
                else:
                    self._send(200)

            def _send(self, status):
                body = b'{"weight_version": "0"}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a probe that gave up (timeouts) is expected
                pass

        self.health_delay_s = health_delay_s
        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def _probe(url: str, **kw):
    from sao_megatron.rollout.health import probe

    async def run():
        async with httpx.AsyncClient(trust_env=False) as http:
            return await probe(http, url, **kw)
    return asyncio.run(run())


def test_probe_tells_ok_busy_stuck_and_dead_apart():
    from sao_megatron.net import free_port
    from sao_megatron.rollout.health import EngineState

    fast, slow, unhealthy = _Engine(0.0), _Engine(2.0), _Engine(0.0, health_status=503)
    try:
        assert _probe(fast.url) is EngineState.OK
        # Not paused by us and /health past its bound or 503 (SGLang: scheduler or detokenizer not answering):
        # alive but stuck, which the supervisor counts towards a restart; never dead (the old client's verdict).
        assert _probe(slow.url, health_timeout_s=0.5) is EngineState.STUCK
        assert _probe(unhealthy.url) is EngineState.STUCK
        assert _probe(unhealthy.url, paused=True) is EngineState.BUSY  # SGLang's 503 of an engine we paused
        start = time.perf_counter()
        assert _probe(slow.url, paused=True) is EngineState.BUSY  # paused: /health is not asked
        assert time.perf_counter() - start < 1.5
        assert _probe(f"http://127.0.0.1:{free_port()}") is EngineState.DEAD
    finally:
        for e in (fast, slow, unhealthy):
            e.close()


def test_client_keeps_a_busy_engine_and_drops_a_dead_one():
    from sao_megatron.net import free_port
    from sao_megatron.rollout.client import RolloutClient

    slow, dead = _Engine(2.0), f"http://127.0.0.1:{free_port()}"

    async def run():
        async with RolloutClient([slow.url, dead], max_connect_retries=1) as client:
            health = await client.health(timeout_s=0.5)
            return health, client.healthy_urls()
    try:
        health, healthy = asyncio.run(run())
    finally:
        slow.close()
    assert health == {slow.url: True, dead: False} and healthy == [slow.url]
