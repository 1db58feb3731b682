"""Clipped PPO (the DPPO of the classic examples), the built-in default, written on the public API.

Groups send segments (``n_steps`` of every env: observations, actions, behaviour log-probabilities, GAE
advantages and returns); the learner updates once per round on every fresh segment
(:mod:`worker.algorithms.ppo_update` has the update, decoupled for policy lag). By default collection
overlaps learning (:meth:`worker.api.Schedule.overlapped`, lag bound ``max_staleness``); ``sync=true`` is the
strict synchronous barrier.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from worker.algorithms import hparams as tables
from worker.algorithms.actor_critic import ActorCritic, ActorCriticLearner, SegmentActor, obs_dtype
from worker.api import Field, LearnerContext, Payload, Schedule

SEGMENT_KEYS = ("obs", "actions", "logp", "advantages", "returns")


def ppo_batch(parts: Sequence[Mapping[str, np.ndarray]], *, continuous: bool) -> dict[str, np.ndarray]:
    """One training batch from the round's segments (concatenated rows)."""
    batch = {k: np.concatenate([p[k] for p in parts]) for k in SEGMENT_KEYS}
    if not continuous:
        batch["actions"] = batch["actions"].astype(np.int64, copy=False)
    return batch


class PPOLearnerRole(ActorCriticLearner):
    def __init__(self, ctx: LearnerContext) -> None:
        super().__init__(ctx)
        from worker.algorithms.ppo_update import PPOLearner

        self.impl = PPOLearner(ctx.model, ctx.hparams, ctx.seed, **self.shape_args())

    def update(self, payloads: Sequence[Payload]) -> Mapping[str, float]:
        lr = self.impl.set_progress(self.ctx.progress())
        stats = self.impl.update(ppo_batch(payloads, continuous=self.impl.continuous))
        return {**stats, "lr": lr}


class PPO(ActorCritic):
    """Clipped PPO with overlapped collection (``--algo ppo``)."""

    name = "ppo"
    hparams = tables.DECLARED["ppo"]
    actor = SegmentActor
    learner = PPOLearnerRole

    def schedule(self) -> Schedule:
        hp = self.hp
        if hp["sync"]:
            return Schedule.sync(max_lag=int(hp["max_staleness"]), max_wait_s=float(hp["update_wait_s"]),
                                 round_size=int(hp["max_queue"]))
        return Schedule.overlapped(max_lag=int(hp["max_staleness"]), max_wait_s=float(hp["update_wait_s"]),
                                   round_size=int(hp["max_queue"]))

    def payload(self, weights: Mapping[str, tuple[int, ...]], trainable: Sequence[str]) -> Mapping[str, Field]:
        s = self.spaces
        return {"obs": Field(obs_dtype(s, self.hp), s.obs_shape), "actions": Field.actions(s),
                "logp": Field("float32"), "advantages": Field("float32"), "returns": Field("float32"),
                **self.moments_schema()}
