"""The trainer's rank-0 view of rollouts: engines, router, client, scheduler, supervisor.

On CPU (``rollout.engine=embedded``) it starts the embedded engines itself
from an HF directory exported from the actor; with ``rollout.engine=sglang`` it
talks to already running SGLang servers (``engine_urls``) through their router.
The asyncio side runs on an :class:`AsyncBridge` thread so generation and
reward computation continue while the actor trains. Weights (the start directory, pushes, the
served version, restarted engines' weights) belong to ``weights.publisher.WeightPublisher``.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
from typing import Any

from sao_megatron.config import DataConfig, ExperimentConfig, RolloutConfig, SchedulerConfig
from sao_megatron.envs.base import Task
from sao_megatron.errors import SaoError
from sao_megatron.models.families import write_hf_template
from sao_megatron.rollout.client import RolloutClient
from sao_megatron.rollout.health import wait_healthy
from sao_megatron.rollout.launch import LocalEngines, SGLangRouterProcess, local_sglang_engines
from sao_megatron.weights.readmission import CurrentWeights, LocalRestarter
from sao_megatron.rollout.router_admin import RouterAdmin
from sao_megatron.rollout.supervisor import EngineSupervisor, Readmit
from sao_megatron.scheduler.sample import Sample
from sao_megatron.scheduler.scheduler import AsyncScheduler
from sao_megatron.rollout.async_bridge import AsyncBridge

log = logging.getLogger(__name__)


class EngineStartError(SaoError):
    """The rollout engines could not be reached or started; nothing was trained."""


def check_reachable(rollout: RolloutConfig) -> None:
    """Before any training: every configured SGLang server (and router) answers /health within
    ``rollout.startup_timeout_s`` (servers launched beside the trainer may still be loading)."""
    if rollout.engine != "sglang" or not rollout.engine_urls:  # none: the trainer starts them (rollout.launch)
        return
    urls = [*rollout.engine_urls, *([rollout.router_url] if rollout.router_url else [])]
    try:
        wait_healthy(urls, timeout_s=rollout.startup_timeout_s, what="rollout engine", api_key=rollout.api_key,
                     interval_s=2.0)
    except TimeoutError as exc:
        raise EngineStartError(f"{exc}: start the SGLang servers first or fix rollout.engine_urls / "
                               "router_url") from exc


def build_rollout_side(cfg: ExperimentConfig, task: Task, *, mode: str, run_dir: pathlib.Path) -> RolloutSide:
    """Rank 0's rollout side from the rollout/scheduler/data sections (``mode``: the resolved
    scheduler mode; groups of ``algorithm.group_size`` unless single)."""
    template = write_hf_template(cfg.model, getattr(task, "tokenizer", None), run_dir / "hf_template")
    group = cfg.algorithm.group_size if mode != "single" else 1
    return RolloutSide(rollout=cfg.rollout, scheduler=cfg.scheduler, data=cfg.data, task=task, mode=mode,
                       group_size=group, run_dir=run_dir, template_dir=template)


class RolloutSide:
    """Owns engines, client and scheduler on trainer rank 0."""

    def __init__(self, *, rollout: RolloutConfig, scheduler: SchedulerConfig, data: DataConfig, task: Task,
                 mode: str, group_size: int, run_dir: pathlib.Path, template_dir: pathlib.Path):
        self.cfg, self.sched_cfg, self.data_cfg, self.task = rollout, scheduler, data, task
        self.mode, self.group_size = mode, group_size
        self.run_dir, self.template_dir = run_dir, template_dir
        self.weights_root = run_dir / "weights"
        self.bridge = AsyncBridge()
        self.engines: LocalEngines | None = None
        self.router: SGLangRouterProcess | None = None
        self.client: RolloutClient | None = None
        self.scheduler: AsyncScheduler | None = None
        self.supervisor: EngineSupervisor | None = None  # restarts dead engines (rollout.supervisor)
        self._supervising: Any = None
        self._urls: list[str] = []
        self._router_url: str | None = None

    # ------------------------------------------------------------------ start / stop
    def start_engines(self, model_dir: pathlib.Path, version: int, *, served: CurrentWeights) -> RolloutClient:
        """Start (or reach) the engines serving ``model_dir`` as ``version``; the client checks they
        serve ``served``'s version (the publisher's). Returns the client."""
        urls = self._start_engines(model_dir, version)
        router_url = self._start_router(urls)
        self.client = RolloutClient(urls, router_url=router_url, api_key=self.cfg.api_key,
                                    timeout_s=self.cfg.request_timeout_s)
        self.client.engine_wait_s = self.cfg.no_engine_timeout_s  # episodes wait for a restart
        health = self.bridge.run(self.client.health(), timeout=60)
        dead = [u for u, ok in health.items() if not ok]
        if dead:
            raise EngineStartError(f"rollout engines not healthy: {dead}. Check that the servers are up "
                                   f"(rollout.engine_urls) or the engine logs under {self.run_dir / 'logs'}")
        self.client.served = served  # from now on an engine serving another version is kept out
        self._urls, self._router_url = urls, router_url
        return self.client

    def start_generation(self, served: CurrentWeights, *, readmit: Readmit,
                         scheduler_state: dict[str, Any] | None) -> None:
        """Start the scheduler at ``served``'s version and the supervisor (``readmit``: the publisher's)."""
        self.scheduler = AsyncScheduler.from_config(
            self.client, self.task, self.sched_cfg, self.data_cfg, self.cfg, group_size=self.group_size,
            version=served.version, mode=self.mode, served=served)
        if scheduler_state is not None:
            self.scheduler.load_state_dict(scheduler_state)
        self.bridge.run(self.scheduler.start())
        self._start_supervisor(self._urls, self._router_url, served, readmit)

    def _start_supervisor(self, urls: list[str], router_url: str | None, served: CurrentWeights,
                          readmit: Readmit) -> None:
        """Dead or hung engines are restarted (embedded: here; sglang: by whoever launched them) and
        readmitted with the current weights (see rollout.supervisor)."""
        launcher = None
        if self.engines is not None:
            launcher = LocalRestarter(self.engines, served, self.bridge.loop, self.weights_root / "restarts",
                                      self.engines.extra_args[2:])  # less the --weight-version it replaces
        router = RouterAdmin(router_url, api_key=self.cfg.api_key) if router_url else None
        self.supervisor = EngineSupervisor(
            self.client, urls, readmit=readmit, launcher=launcher, router=router, api_key=self.cfg.api_key,
            restart_budget=self.cfg.engine_restart_budget, no_engine_timeout_s=self.cfg.no_engine_timeout_s)
        self._supervising = self.bridge.run(_spawn(self.supervisor.run()))

    def _start_engines(self, model_dir: pathlib.Path, version: int) -> list[str]:
        extra = ["--weight-version", str(version), "--skip-tokenizer-init",
                 *(["--enable-return-routed-experts"] if self.cfg.routing_replay else [])]
        if self.cfg.engine == "sglang" and self.cfg.engine_urls:
            return list(self.cfg.engine_urls)
        if self.cfg.engine == "sglang":  # no URLs: real SGLang servers on this machine
            try:
                self.engines = local_sglang_engines(self.cfg, model_dir, log_dir=self.run_dir / "logs",
                                                    extra_args=extra)
            except ValueError as exc:
                raise EngineStartError(str(exc)) from exc
        else:
            self.engines = LocalEngines(model_dir, self.cfg.num_engines, api_key=self.cfg.api_key,
                                        extra_args=extra, log_dir=self.run_dir / "logs")
        try:
            self.engines.start()
        except Exception as exc:
            raise EngineStartError(f"{self.cfg.engine} engines failed to start: {exc}") from exc
        return list(self.engines.urls)

    def _start_router(self, urls: list[str]) -> str | None:
        if self.cfg.router != "sglang_router":
            return None
        if self.cfg.router_url:
            return self.cfg.router_url
        self.router = SGLangRouterProcess(urls, api_key=self.cfg.api_key, tokenizer_path=str(self.template_dir),
                                          log_dir=self.run_dir / "logs")
        self.router.start()
        return self.router.url

    def close(self) -> None:
        try:
            if self.supervisor is not None:
                self.bridge.run(_stop_supervisor(self.supervisor, self._supervising), timeout=30)
            if self.scheduler is not None:
                self.bridge.run(self.scheduler.stop(), timeout=60)
            if self.client is not None:
                self.bridge.run(self.client.aclose(), timeout=30)
        except Exception as exc:  # shutting down: report, keep closing
            log.warning("rollout shutdown: %s", exc)
        finally:
            if self.router is not None:
                self.router.stop()
            if self.engines is not None:
                self.engines.stop()
            self.bridge.close()

    # ------------------------------------------------------------------ data and weights
    def next_batch(self, batch_size: int, *, version: int | None = None) -> list[Sample]:
        """The next batch, for the trainer at ``version`` (staleness is judged against it; None: the served
        version); NoEngineError once no engine was healthy for rollout.no_engine_timeout_s."""
        assert self.scheduler is not None
        return self.bridge.run(self._batch_or_no_engine(batch_size, version))

    async def _batch_or_no_engine(self, batch_size: int, version: int | None) -> list[Sample]:
        if self.supervisor is None:
            return await self.scheduler.next_batch(batch_size, version=version)
        batch = asyncio.ensure_future(self.scheduler.next_batch(batch_size, version=version))
        gone = asyncio.ensure_future(self.supervisor.wait_no_engine())
        await asyncio.wait({batch, gone}, return_when=asyncio.FIRST_COMPLETED)
        if batch.done():
            gone.cancel()
            return batch.result()
        batch.cancel()  # next_batch puts back what it took: nothing is lost for the checkpoint
        await asyncio.gather(batch, return_exceptions=True)
        raise gone.result()

    def take_dropped(self) -> list[tuple[Sample, int]]:
        """Samples dropped as stale since the last call, with the version they were dropped at (audit)."""
        assert self.scheduler is not None
        return self.bridge.run(_call(self.scheduler.take_dropped))

    def reset_admission_budget(self) -> None:
        """After a batch consumed without a policy update (value pretraining): admit a new batch's worth."""
        assert self.scheduler is not None
        self.bridge.run(_call(self.scheduler.reset_admission_budget))

    def metrics(self) -> dict[str, float]:
        assert self.scheduler is not None
        out = self.bridge.run(_call(self.scheduler.metrics))
        return out | (self.supervisor.metrics() if self.supervisor is not None else {})

    def state_dict(self) -> dict[str, Any]:
        assert self.scheduler is not None
        return self.bridge.run(_call(self.scheduler.state_dict))


async def _call(fn):
    return fn()


async def _spawn(coro) -> asyncio.Task:
    return asyncio.ensure_future(coro)


async def _stop_supervisor(supervisor: EngineSupervisor, task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await supervisor.aclose()
