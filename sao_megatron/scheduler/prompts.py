"""Which prompt comes next: epochs over a shuffled dataset, re-queued prompts first.

A prompt reference is ``(epoch, index)``: the pair is unique per trained sample in single mode
(per group in group mode). Re-queued prompts (dropped as stale, discarded by a weight update, in
flight at a checkpoint, failed) are served before fresh ones so they do not wait for the next
epoch; ``attempt`` counts how many times a reference was started.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class PromptRef:
    """One scheduled use of a dataset prompt."""

    epoch: int
    index: int
    attempt: int = 1


class PromptCursor:
    """Deterministic data order (seed, epoch) plus a re-queue; fully described by ``state_dict``."""

    def __init__(self, num_prompts: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if num_prompts < 1:
            raise ValueError("the dataset is empty: the scheduler needs at least one prompt")
        self.num_prompts = num_prompts
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self.requeued: deque[PromptRef] = deque()
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.num_prompts))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self) -> PromptRef:
        if self.requeued:
            return self.requeued.popleft()
        if self.position == self.num_prompts:
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        ref = PromptRef(self.epoch, self._order[self.position])
        self.position += 1
        return ref

    def requeue(self, ref: PromptRef) -> None:
        self.requeued.append(PromptRef(ref.epoch, ref.index, ref.attempt + 1))

    def state_dict(self) -> dict:
        return {"num_prompts": self.num_prompts, "seed": self.seed, "shuffle": self.shuffle,
                "epoch": self.epoch, "position": self.position,
                "requeued": [[r.epoch, r.index, r.attempt] for r in self.requeued]}

    def load_state_dict(self, state: dict) -> None:
        if state["num_prompts"] != self.num_prompts:
            raise ValueError(f"checkpointed data cursor is for {state['num_prompts']} prompts but the dataset "
                             f"has {self.num_prompts}: resume with the same dataset")
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.position = state["epoch"], state["position"]
        self.requeued = deque(PromptRef(*r) for r in state["requeued"])
        self._order = self._epoch_order(self.epoch)
