"""`sao-megatron train`: the SAO loop on Megatron actor + critic with asynchronous rollouts.

Per step (docs/architecture.md#the-loop): take the first B finished samples, run ``rl_step.update`` on them
(critic values → advantages → actor step → K critic steps), push the actor's weights to the engines
(version + 1; with ``rollout.weight_sync.overlap`` started after the actor's step, while the critic and the
next step train), log, checkpoint. Rank 0 owns the rollout side; every rank trains its data-parallel shard.
Parts come from ``training.run.components``; checkpoints and the audit live in ``training.run.run_state``.
"""

from __future__ import annotations

import logging
import pathlib
import signal
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from sao_megatron.config import ExperimentConfig, to_dict, write_resolved
from sao_megatron.parallel.collectives import any_rank, broadcast_object, rank0_call
from sao_megatron.scheduler.sample import Sample
from sao_megatron.training.step import rl_step
from sao_megatron.training.step.batch import prepare_local_batch
from sao_megatron.training.run.components import Components, build_components, initial_weights
from sao_megatron.training.run.evaluation import PeriodicEval
from sao_megatron.training.run.metrics_log import MetricsLogger, reward_summary
from sao_megatron.training.step.offload import park
from sao_megatron.training.step.optim import NonFiniteGuard
from sao_megatron.weights.publisher import WeightPublisher
from sao_megatron.training.run.run_state import RunState
from sao_megatron.training.step.step_metrics import batch_metrics

log = logging.getLogger(__name__)


class Trainer:
    """Runs (or resumes) the RL loop over the components ``build_components(cfg)`` made."""

    def __init__(self, cfg: ExperimentConfig, run_dir: str | pathlib.Path, *, resume: str = "auto",
                 components: Components | None = None):
        self.cfg, self.run_dir, self.resume = cfg, pathlib.Path(run_dir), resume
        self.c = components or build_components(cfg)
        self.rank0 = dist.get_rank() == 0
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_resolved(cfg, self.run_dir, scheduler_mode=self.c.mode)
        self.settings = rl_step.StepSettings.from_config(cfg)
        self.state = RunState(self.run_dir, keep_last=cfg.checkpoint.keep_last, rank0=self.rank0,
                              offload=self.settings.offload, async_save=cfg.checkpoint.async_save,
                              verify_checksums=cfg.checkpoint.verify_checksums)
        self.step = 0
        self.publisher = WeightPublisher(cfg, self.c.exporter, self.run_dir, rank0=self.rank0)  # owns the weight version
        self.guard = NonFiniteGuard(cfg.run.max_nan_steps)
        self.rollout = None
        self.logger = (MetricsLogger(self.run_dir, cfg.logging, run_name=self.run_dir.name,
                                     config_dict=to_dict(cfg)) if self.rank0 else None)
        self._stop_signal: int | None = None
        self._start_eval: dict[str, float] = {}
        self._rows: dict[int, dict[str, Any]] = {}  # steps whose overlapped push is still in flight
        self.evaluator = (PeriodicEval.from_config(cfg.eval, self.c.task, cfg.data, cfg.rollout,
                                                   num_steps=cfg.run.num_steps) if self.rank0 else None)
        if self.settings.offload:  # Megatron logs every move at INFO (four lines a step); its setup is done
            logging.getLogger("megatron.core.optimizer.optimizer").setLevel(logging.WARNING)

    @property
    def version(self) -> int:
        """The actor's policy version, updates applied (the publisher's; the engines serve it once no push is
        in flight: ``publisher.served``): samples are trained, audited and judged stale against it."""
        return self.publisher.version

    def run(self) -> int:
        """Train to ``run.num_steps``; returns 0 when done (also after a signal-triggered checkpoint)."""
        self._install_signal_handlers()
        done = False
        try:
            from sao_megatron.training.run.rollout_side import check_reachable

            rank0_call(lambda: check_reachable(self.cfg.rollout))
            state = self._restore()
            if self.rank0:  # metrics.jsonl / TensorBoard / wandb continue from the checkpoint's step
                self.logger.resume_at(self.step)
            if state is None:
                if self.rank0:  # a run killed before its first checkpoint starts over
                    self.state.truncate_audit(0)
                initial_weights(self.c, self.cfg)
            for model in self.c.models().values():  # loaded and warmed up: the optimizers go idle
                if model is not None:
                    park(model, offload=self.settings.offload)
            self._start_rollout(state)
            if state is None and self.c.critic is not None and self.cfg.critic.pretrain_steps:
                self._pretrain_critic()
            if state is None and self.rank0:  # eval.before_train: logged with the first step
                self._start_eval = self.evaluator.before_training(self.rollout, self.version)
            while self.step < self.cfg.run.num_steps:
                self._log(self.train_step())
                self.state.saves.poll()  # publishes a finished async checkpoint
                every = self.cfg.checkpoint.save_interval
                if (every and self.step % every == 0) or any_rank(self._stop_signal is not None):
                    self.save()
                    if self._stop_signal is not None:
                        self.state.saves.wait()
                        log.warning("signal %s: checkpointed at step %d, exiting", self._stop_signal, self.step)
                        return 0
            self.publisher.wait()  # the engines serve the final version; a failed last push raises here
            if self.rank0:
                self._flush_rows()  # the last step's row, with its push
            self.state.saves.wait()
            if self.state.ckpt.latest() != self.state.ckpt.final_dir(self.step):
                self.save()
                self.state.saves.wait()
            if self.rank0 and (line := reward_summary(self.run_dir)):
                log.info("done: %s", line)
            done = True
            return 0
        finally:
            self.close(raise_push_error=done)

    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        if not self.publisher.overlaps_batch:  # η = 0: no sample of the new version exists before its push ends
            self.publisher.wait()
        samples = self._next_batch()
        t1 = time.perf_counter()
        # The actor's version (updates applied), not the engines' (one behind while a push is in flight).
        self.state.audit(samples, step=self.step, version=self.version, phase="rl")
        self.state.audit_dropped(self.rollout.take_dropped() if self.rank0 else [], step=self.step)
        t_audit = time.perf_counter()
        pushed: dict[str, float] = {}

        def push() -> None:  # the actor's weights are final; overlapped, the push runs while the critic trains
            pushed.update(self.publisher.publish(step=self.step))

        result = self.update(samples, after_actor=push if self.publisher.overlap else None)
        train_s = time.perf_counter() - t_audit - pushed.get("timing/weight_sync_s", 0.0)  # less its blocking part
        if result.applied and not self.publisher.overlap:
            push()
        self.step += 1
        metrics = result.metrics | pushed | {
            "version": self.version, "timing/wait_batch_s": t1 - t0, "timing/train_s": train_s,
            "timing/audit_s": t_audit - t1, "timing/step_s": time.perf_counter() - t0}
        metrics["timing/tokens_per_s"] = metrics.get("batch/num_tokens", 0.0) / max(metrics["timing/step_s"], 1e-9)
        return metrics

    def update(self, samples: list[Sample], *, after_actor: Callable[[], None] | None = None) -> rl_step.StepResult:
        """Collective: one RL step on ``samples`` (``rl_step.update``; ``after_actor`` runs once the actor's
        update is applied) and the non-finite guard; the result's metrics include the batch's."""
        cfg, c, version = self.cfg, self.c, self.version
        batch = prepare_local_batch(samples, c.ctx, max_tokens=cfg.actor.max_tokens_per_microbatch,
                                    vocab_size=cfg.model.vocab_size, min_microbatches=cfg.actor.num_minibatches)
        result = rl_step.update(c.actor, c.critic, batch, self.settings, ctx=c.ctx, baseline=c.baseline,
                                after_actor=after_actor)
        self.guard.record(result.actor, self.step)
        result.metrics |= batch_metrics(samples, batch.full, version)
        return result

    def _pretrain_critic(self) -> None:
        """Value pretraining on rollouts of the frozen initial policy (actor untouched, version 0)."""
        cfg = self.cfg
        for i in range(cfg.critic.pretrain_steps):
            samples = self._next_batch()
            batch = prepare_local_batch(samples, self.c.ctx, max_tokens=cfg.critic.max_tokens_per_microbatch,
                                        vocab_size=cfg.model.vocab_size)
            results = rl_step.value_pretrain_step(self.c.critic, batch, self.settings, ctx=self.c.ctx)
            self.state.audit(samples, step=self.step, version=self.version, phase="value_pretrain")
            if self.rank0:  # no policy update happened: the staleness budget must not shrink
                self.rollout.reset_admission_budget()
                log.info("value pretraining %d/%d: critic loss %.4f", i + 1, cfg.critic.pretrain_steps,
                         results[-1].loss)

    def _next_batch(self) -> list[Sample]:
        from sao_megatron.rollout.supervisor import NoEngineError

        def rank0() -> list[Sample] | str:
            try:
                return self.rollout.next_batch(self.cfg.scheduler.batch_size, version=self.version)
            except NoEngineError as exc:  # every rank must learn it, then checkpoint together
                return str(exc)
        got = broadcast_object(rank0() if self.rank0 else None)
        if isinstance(got, str):
            self.save()
            self.state.saves.wait()
            raise NoEngineError(got)
        return got

    def _start_rollout(self, state: dict[str, Any] | None) -> None:
        from sao_megatron.training.run.rollout_side import build_rollout_side

        self.rollout = self.publisher.start(
            lambda: build_rollout_side(self.cfg, self.c.task, mode=self.c.mode, run_dir=self.run_dir),
            (state or {}).get("scheduler"))

    def save(self) -> None:
        """Collective: models + optimizers + trainer state into an atomic checkpoint directory (after the push
        in flight: the checkpoint's version is the one the engines serve and the scheduler counts with)."""
        self.publisher.wait()
        if self.rank0:
            self._flush_rows()  # every row before the checkpoint is in metrics.jsonl when it commits
        self.state.save(self.step, self.c.models(), {
            "step": self.step, "version": self.version, "nan_streak": self.guard.streak,
            "scheduler": self.rollout.state_dict() if self.rollout else None,
            "baseline": self.c.baseline.state_dict() if self.c.baseline else None})

    def _restore(self) -> dict[str, Any] | None:
        path = self.state.resume_path(self.resume, self.cfg.checkpoint.load)
        if path is None:
            return None
        state = self.state.restore(path, self.c.models())
        self.step, self.guard.streak = state["step"], state["nan_streak"]
        self.publisher.restore(state["version"])
        if self.c.baseline is not None:
            self.c.baseline.load_state_dict(state["baseline"])
        return state

    def _log(self, metrics: dict[str, Any]) -> None:
        if self.rank0:  # logged under the 0-based index of the step just trained
            metrics |= self.rollout.metrics()
            if self.evaluator.due(self.step):  # sample from the weights just published
                self.publisher.wait_local()
            metrics |= self.evaluator.maybe_run(self.step, self.rollout, self.publisher.served.version)
            metrics |= self._start_eval
            self._start_eval = {}
            self._rows[self.step - 1] = metrics
            self._flush_rows()

    def _flush_rows(self, *, final: bool = False) -> None:
        """(rank 0) Log the rows whose push is done, each with its own push's metrics. An overlapped push
        finishes during the next step: its row waits for it (a row logs one step late), and the last
        push's metrics are logged too. ``final``: log every row (a push that never finished: without)."""
        for step, pushed in self.publisher.take_finished():
            if step in self._rows:
                self._rows[step] |= pushed
        stop = None if final else self.publisher.in_flight_step
        for step in sorted(self._rows):
            if step == stop:
                break  # later rows wait too: metrics.jsonl stays in step order
            self.logger.log(step, self._rows.pop(step))

    def _install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):  # checkpoint and exit after the step in progress
            signal.signal(sig, lambda signum, _frame: setattr(self, "_stop_signal", signum))

    def close(self, *, raise_push_error: bool = True) -> None:
        """Waits for the push in flight and closes everything; its error raises after closing unless
        ``raise_push_error`` is False (another error is already on its way out: the push's is logged)."""
        error = None
        if raise_push_error:
            try:
                self.publisher.wait()
            except Exception as exc:  # noqa: BLE001 - raised once everything is closed
                error = exc
        self.publisher.close()
        if self.rollout is not None:
            self.rollout.close()
        if self.logger is not None:  # rank 0's
            self._flush_rows(final=True)
            self.logger.close()
        if error is not None:
            raise error
