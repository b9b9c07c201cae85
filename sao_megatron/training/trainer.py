"""`sao-megatron train`: the SAO loop on Megatron actor + critic with asynchronous rollouts.

Per step (DESIGN.md §1–2): take the first B finished samples → critic values →
skip-observation GAE → actor DIS step → K critic steps → stream the actor's
weights to the engines (version + 1). Rank 0 owns the rollout side; every rank
trains its data-parallel shard of the same batch.
"""

from __future__ import annotations

import json
import logging
import pathlib
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

from sao_megatron.algorithms.advantages import RunningMeanBaseline
from sao_megatron.config import ExperimentConfig, to_dict, write_resolved
from sao_megatron.config.validate import resolved_mode
from sao_megatron.envs import build_task
from sao_megatron.errors import SaoError
from sao_megatron.models.families import get_family
from sao_megatron.scheduler.sample import Sample, collate
from sao_megatron.training import rl_step
from sao_megatron.training.checkpoint import load_checkpoint, save_checkpoint
from sao_megatron.training.collectives import any_rank, broadcast_object, gather_metrics, rank0_call
from sao_megatron.training.distributed import init_distributed
from sao_megatron.training.export import ExportPlan, iter_hf_tensors, iter_owned_hf_tensors, owns_tensors
from sao_megatron.training.metrics_log import MetricsLogger
from sao_megatron.training.models import build_actor, build_critic
from sao_megatron.training.offload import park, resident
from sao_megatron.training.run_state import CheckpointManager, capture_rng, restore_rng, write_json_atomic
from sao_megatron.training.step_metrics import batch_metrics, policy_metrics, value_metrics

log = logging.getLogger(__name__)


class NonFiniteLossError(SaoError):
    """Too many consecutive steps had a non-finite loss."""


class Trainer:
    """Builds everything from an ExperimentConfig and runs (or resumes) the RL loop."""

    def __init__(self, cfg: ExperimentConfig, run_dir: str | pathlib.Path, *, resume: str = "auto"):
        self.cfg, self.run_dir, self.resume = cfg, pathlib.Path(run_dir), resume
        cfg.scheduler.mode = resolved_mode(cfg)  # "auto" -> single | group, recorded in the resolved config
        self.ctx = init_distributed(cfg.parallel, seed=cfg.run.seed)
        self.rank0 = dist.get_rank() == 0
        self.needs_critic = cfg.algorithm.name in rl_step.CRITIC_ALGORITHMS
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_resolved(cfg, self.run_dir)
        self.task = rank0_call(lambda: build_task(cfg.data, model=cfg.model))  # bad datasets fail here, on every rank
        steps = cfg.run.num_steps
        self.actor = build_actor(cfg.model, cfg.actor.optimizer, self.ctx, total_steps=steps,
                                 recompute=cfg.actor.recompute_granularity)
        self.critic = (build_critic(cfg.model, cfg.critic, self.ctx, self.actor.chunks, total_steps=steps)
                       if self.needs_critic else None)
        self.baseline = (RunningMeanBaseline(momentum=cfg.algorithm.running_mean_momentum)
                         if cfg.algorithm.name == "sao_running_mean" else None)
        self.export_plan = ExportPlan(self.actor.chunks, get_family(cfg.model.family).weight_map(cfg.model),
                                      bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20)
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last)
        self.step = self.version = self.nan_streak = 0
        self.rollout = None
        self.weight_sync = None  # rollout.weight_sync=distributed: every rank sends what it owns
        self.logger = (MetricsLogger(self.run_dir, cfg.logging, run_name=self.run_dir.name,
                                     config_dict=to_dict(cfg)) if self.rank0 else None)
        self._stop_signal: int | None = None
        self.offload = cfg.resources.offload_idle_optimizer  # only the stepping model's optimizer on the GPU
        if self.offload:  # Megatron logs every move at INFO (four lines a step); its setup lines are done by now
            logging.getLogger("megatron.core.optimizer.optimizer").setLevel(logging.WARNING)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        """Train to ``run.num_steps``; returns 0 when done (also after a signal-triggered checkpoint)."""
        self._install_signal_handlers()
        try:
            from sao_megatron.training.rollout_side import check_reachable

            rank0_call(lambda: check_reachable(self.cfg.rollout))
            state = self._restore()
            if state is None:
                if self.rank0:  # a run killed before its first checkpoint starts over
                    (self.run_dir / "audit.jsonl").unlink(missing_ok=True)
                self._initial_weights()
            for model in (self.actor, self.critic):  # loaded and warmed up: the optimizers go idle
                if model is not None:
                    park(model, offload=self.offload)
            self._start_rollout(state)
            if state is None and self.critic is not None and self.cfg.critic.pretrain_steps:
                self._pretrain_critic()
            while self.step < self.cfg.run.num_steps:
                self._log(self.train_step())
                if self._should_save() or any_rank(self._stop_signal is not None):
                    self.save()
                    if self._stop_signal is not None:
                        log.warning("signal %s: checkpointed at step %d, exiting", self._stop_signal, self.step)
                        return 0
            if not self.ckpt.latest() or self.ckpt.latest() != self.ckpt.final_dir(self.step):
                self.save()
            if self.rank0:
                self._summary()
            return 0
        finally:
            self.close()

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        samples = self._next_batch()
        t1 = time.perf_counter()
        self._audit(samples, phase="rl")  # at the version the samples were consumed (trained) at
        metrics = self._update(samples)
        t2 = time.perf_counter()
        if metrics.pop("_applied"):
            self.version += 1
            metrics |= self._sync_weights()
        self.step += 1
        metrics |= {"version": self.version, "timing/wait_batch_s": t1 - t0, "timing/train_s": t2 - t1,
                    "timing/step_s": time.perf_counter() - t0}
        metrics["timing/tokens_per_s"] = metrics.get("batch/num_tokens", 0.0) / max(metrics["timing/step_s"], 1e-9)
        return metrics

    # ------------------------------------------------------------------ one update
    def _update(self, samples: list[Sample]) -> dict[str, Any]:
        cfg, ctx = self.cfg, self.ctx
        full = collate(samples, pad_to_multiple=ctx.tp_size)
        rl_step.check_token_ids(full["tokens"], cfg.model.vocab_size)
        batch = rl_step.build_local_batch(full, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size,
                                          max_tokens=cfg.actor.max_tokens_per_microbatch, pad_multiple=ctx.tp_size)
        batch.outcome_advantages = rl_step.outcome_advantages(full, cfg.algorithm, self.baseline)
        values = rl_step.critic_values(self.critic, batch, ctx=ctx) if self.critic else None
        rl_step.attach_advantages(batch, cfg.algorithm, values)
        with resident(self.actor, offload=self.offload):
            actor = rl_step.actor_update(self.actor, batch, cfg.algorithm, ctx=ctx, vocab_size=cfg.model.vocab_size,
                                         temperature=cfg.rollout.temperature, entropy_coef=cfg.actor.entropy_coef)
        local = policy_metrics(batch, actor.outputs, cfg.algorithm) if actor.outputs else {}
        if self.critic is not None:
            with resident(self.critic, offload=self.offload):
                critic_results = [rl_step.critic_update(self.critic, batch, ctx=ctx, value_clip=cfg.critic.value_clip)
                                  for _ in range(cfg.critic.num_updates_per_step)]
            local |= value_metrics(batch, critic_results) if actor.outputs else {}
        contributes = ctx.is_last_stage and ctx.tp_rank == 0
        metrics = gather_metrics(local if contributes else {}, float(sum(mb["action_mask"].sum()
                                                                         for mb in batch.microbatches)))
        self._check_finite(actor.applied)
        metrics |= batch_metrics(samples, full, self.version) | {
            "actor/loss": actor.loss, "actor/grad_norm": actor.grad_norm or 0.0, "actor/lr": actor.lr,
            "actor/update_applied": float(actor.applied), "_applied": actor.applied}
        if self.critic is not None:
            metrics |= {"critic/loss": critic_results[-1].loss, "critic/lr": critic_results[-1].lr}
        return metrics

    def _check_finite(self, applied: bool) -> None:
        self.nan_streak = 0 if applied else self.nan_streak + 1
        if self.nan_streak:
            log.warning("step %d: non-finite loss or gradients, update skipped (%d in a row)", self.step,
                        self.nan_streak)
        if self.nan_streak >= self.cfg.run.max_nan_steps:
            raise NonFiniteLossError(f"{self.nan_streak} consecutive steps had non-finite losses/gradients; "
                                     "lower the learning rate or check rewards/log-probs (run.max_nan_steps)")

    # ------------------------------------------------------------------ rollout side
    def _next_batch(self) -> list[Sample]:
        return broadcast_object(self.rollout.next_batch(self.cfg.scheduler.batch_size) if self.rank0 else None)

    def _export(self):
        return iter_hf_tensors(self.export_plan, receivers="rank0")

    def _drain(self, gen) -> None:
        for _ in gen:  # keep the export's collectives in lockstep
            pass

    def _start_rollout(self, state: dict[str, Any] | None) -> None:
        from sao_megatron.training.rollout_side import RolloutSide, write_hf_template

        gen = self._export()

        def start():
            template = write_hf_template(self.cfg.model, self.task, self.run_dir / "hf_template")
            group = self.cfg.algorithm.group_size if self.cfg.scheduler.mode != "single" else 1
            self.rollout = RolloutSide(rollout=self.cfg.rollout, scheduler=self.cfg.scheduler, data=self.cfg.data,
                                       task=self.task, group_size=group, run_dir=self.run_dir,
                                       template_dir=template)
            try:
                self.rollout.start(gen, version=self.version, scheduler_state=(state or {}).get("scheduler"))
            finally:
                self._drain(gen)

        rank0_call(start, others=lambda: self._drain(gen))
        if self.cfg.rollout.weight_sync != "disk":
            from sao_megatron.rollout.weight_sync import build_weight_sync

            self.weight_sync = build_weight_sync(self.cfg.rollout, client=None, run_dir=self.run_dir,
                                                 template_dir=None)
            self.weight_sync.connect(self.rollout.client.engine_urls if self.rank0 else None,
                                     is_sender=owns_tensors(self.export_plan))

    def _sync_weights(self) -> dict[str, float]:
        t0 = time.perf_counter()
        if self.weight_sync is not None:  # collective: each owner sends its own tensors
            out = self.weight_sync.push(iter_owned_hf_tensors(self.export_plan), self.version,
                                        paused=self.rollout.paused(self.version) if self.rank0 else None)
            out = {"rollout/weight_sync_bytes": out["weight_sync/bytes"], **out} if self.rank0 else {}
        else:
            gen = self._export()
            out = rank0_call(lambda: self.rollout.push_weights(gen, self.version), others=lambda: self._drain(gen))
        return (out or {}) | {"timing/weight_sync_s": time.perf_counter() - t0}

    def _pretrain_critic(self) -> None:
        """Value pretraining on rollouts of the frozen initial policy (actor untouched, version 0)."""
        cfg = self.cfg
        for i in range(cfg.critic.pretrain_steps):
            samples = self._next_batch()
            full = collate(samples, pad_to_multiple=self.ctx.tp_size)
            rl_step.check_token_ids(full["tokens"], cfg.model.vocab_size)
            batch = rl_step.build_local_batch(full, dp_rank=self.ctx.dp_rank, dp_size=self.ctx.dp_size,
                                              max_tokens=cfg.critic.max_tokens_per_microbatch,
                                              pad_multiple=self.ctx.tp_size)
            rl_step.attach_advantages(batch, cfg.algorithm, rl_step.critic_values(self.critic, batch, ctx=self.ctx))
            with resident(self.critic, offload=self.offload):
                results = [rl_step.critic_update(self.critic, batch, ctx=self.ctx, value_clip=cfg.critic.value_clip)
                           for _ in range(cfg.critic.num_updates_per_step)]
            self._audit(samples, phase="value_pretrain")
            if self.rank0:  # no policy update happened: the staleness budget must not shrink
                self.rollout.reset_admission_budget()
            if self.rank0:
                log.info("value pretraining %d/%d: critic loss %.4f", i + 1, cfg.critic.pretrain_steps,
                         results[-1].loss)

    # ------------------------------------------------------------------ weights, checkpoints
    def _initial_weights(self) -> None:
        cfg = self.cfg
        if cfg.actor.load:
            load_checkpoint(cfg.actor.load, self.actor.chunks)
        elif cfg.model.hf_dir:
            from sao_megatron.models.families.sharded import load_hf_dir

            load_hf_dir(self.actor.chunks, cfg.model, cfg.model.hf_dir)
        if cfg.run.sft_steps:
            from sao_megatron.training.sft import supervised_warmup

            supervised_warmup(self)
        if self.critic is None:
            return
        if cfg.critic.init_from != "actor":
            load_checkpoint(cfg.critic.init_from, self.critic.chunks)
        else:  # copy the actor's final starting weights (loaded and/or warmed up after the critic was built)
            from sao_megatron.models.critic import init_critic_from_actor

            init_critic_from_actor(self.critic.chunks, self.actor.chunks)

    def _should_save(self) -> bool:
        every = self.cfg.checkpoint.save_interval
        return bool(every) and self.step % every == 0

    def save(self) -> None:
        """Collective: models + optimizers + trainer state into an atomic checkpoint directory."""
        part = self.ckpt.partial_dir(self.step)
        if self.rank0:
            self.ckpt.begin(self.step)
        dist.barrier()
        with resident(self.actor, offload=self.offload):
            save_checkpoint(part / "actor", self.actor.chunks, self.actor.optimizer)
        if self.critic is not None:
            with resident(self.critic, offload=self.offload):
                save_checkpoint(part / "critic", self.critic.chunks, self.critic.optimizer)
        (part / "rng").mkdir(exist_ok=True)
        torch.save(capture_rng(), part / "rng" / f"rank_{dist.get_rank()}.pt")
        if self.rank0:
            write_json_atomic(part / "trainer_state.json", self._trainer_state())
        dist.barrier()
        if self.rank0:
            self.ckpt.commit(self.step)
            log.info("checkpoint step %d -> %s", self.step, self.ckpt.final_dir(self.step))
        dist.barrier()

    def _trainer_state(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "nan_streak": self.nan_streak,
                "scheduler": self.rollout.state_dict() if self.rollout else None,
                "baseline": self.baseline.state_dict() if self.baseline else None,
                "actor_lr": self.actor.scheduler.state_dict(),
                "critic_lr": self.critic.scheduler.state_dict() if self.critic else None}

    def _restore(self) -> dict[str, Any] | None:
        path = self._resume_path()
        if path is None:
            return None
        load_checkpoint(path / "actor", self.actor.chunks, self.actor.optimizer)
        if self.critic is not None:
            load_checkpoint(path / "critic", self.critic.chunks, self.critic.optimizer)
        state = json.loads((path / "trainer_state.json").read_text())
        self.step, self.version, self.nan_streak = state["step"], state["version"], state["nan_streak"]
        self.actor.scheduler.load_state_dict(state["actor_lr"])
        if self.critic is not None:
            self.critic.scheduler.load_state_dict(state["critic_lr"])
        if self.baseline is not None:
            self.baseline.load_state_dict(state["baseline"])
        rng = path / "rng" / f"rank_{dist.get_rank()}.pt"
        if rng.is_file():  # absent when resuming at another world size
            restore_rng(torch.load(rng, weights_only=False))
        if self.rank0:
            self._truncate_audit()
            log.info("resumed from %s (step %d, version %d)", path, self.step, self.version)
        return state

    def _resume_path(self) -> pathlib.Path | None:
        if self.resume in ("never", "", None):
            if self.ckpt.latest() is not None:
                raise ValueError(f"{self.run_dir} already holds checkpoints; pass --resume auto to continue "
                                 "or choose a fresh --run-dir")
            return self._check_load(self.cfg.checkpoint.load)
        if self.resume == "auto":
            return self.ckpt.latest() or self._check_load(self.cfg.checkpoint.load)
        return self._check_load(self.resume)

    @staticmethod
    def _check_load(path: str | None) -> pathlib.Path | None:
        if path is None:
            return None
        p = pathlib.Path(path)
        if not (p / "trainer_state.json").is_file():
            raise ValueError(f"{p} is not a sao-megatron checkpoint (no trainer_state.json); pass a "
                             "RUN_DIR/checkpoints/step_N directory")
        return p

    # ------------------------------------------------------------------ logging, audit, signals
    def _log(self, metrics: dict[str, Any]) -> None:
        if self.rank0:  # logged under the 0-based index of the step just trained
            metrics |= self.rollout.metrics()
            self.logger.log(self.step - 1, metrics)

    def _audit(self, samples: list[Sample], *, phase: str) -> None:
        """RUN_DIR/audit.jsonl: one line per trained sample (exactly-once checks, staleness audit).

        ``version`` is the trainer version the sample was trained at; lines of steps after the
        last checkpoint are dropped on resume (those samples are trained again)."""
        if not self.rank0:
            return
        with (self.run_dir / "audit.jsonl").open("a") as f:
            for s in samples:
                f.write(json.dumps({"step": self.step, "version": self.version, "phase": phase, "index": s.index,
                                    "epoch": s.epoch, "attempt": s.attempt, "group_id": s.group_id,
                                    "oldest_version": s.oldest_version(), "reward": s.reward}) + "\n")

    def _truncate_audit(self) -> None:
        """Drop audit lines of steps after the checkpoint: those samples are trained again on resume."""
        path = self.run_dir / "audit.jsonl"
        if path.is_file():
            keep = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] < self.step]
            path.write_text("".join(ln + "\n" for ln in keep))

    def _summary(self) -> None:
        """One line a person can check: did the reward go up over the run?"""
        from sao_megatron.training.metrics_log import read_metrics

        rewards = [r["reward/mean"] for r in read_metrics(self.run_dir) if isinstance(r.get("reward/mean"), float)]
        if len(rewards) >= 10:
            head, tail = rewards[: max(1, len(rewards) // 10)], rewards[-max(1, len(rewards) // 5):]
            log.info("done: %d steps; reward/mean %.3f over the first 10%% of steps -> %.3f over the last 20%%",
                     len(rewards), sum(head) / len(head), sum(tail) / len(tail))

    def _install_signal_handlers(self) -> None:
        def handler(signum, _frame):
            self._stop_signal = signum

        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, handler)

    def close(self) -> None:
        if self.weight_sync is not None:
            self.weight_sync.close()
        if self.rollout is not None:
            self.rollout.close()
        if self.logger is not None:
            self.logger.close()
