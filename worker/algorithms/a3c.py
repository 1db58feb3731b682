"""A3C, written on the public API: each group computes the actor-critic gradient of its own segment (with
TensorFlow, once per group) and sends it; the master applies each gradient as it comes
(:meth:`worker.api.Schedule.asynchronous`, gradients more than ``max_staleness`` versions old dropped) and
answers that group alone with the current weights.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from worker.algorithms import hparams as tables
from worker.algorithms.actor_critic import LOG_STD, ActorCritic, ActorCriticLearner, SegmentActor
from worker.api import ActorContext, Field, LearnerContext, Payload, Schedule

LOSS_NAMES = ("policy_loss", "value_loss", "entropy")


class A3CActor(SegmentActor):
    """A segment, then its gradient at the weights that acted (the master counts the gradient's staleness)."""

    def __init__(self, ctx: ActorContext) -> None:
        super().__init__(ctx)
        from worker.algorithms.a3c_grads import A3CGradients

        model = ctx.keras_model()  # TensorFlow in the group: one runtime, made once
        names = {id(v): n for n, v in ctx.variables().items()}
        self.grads = A3CGradients(model, [names[id(v)] for v in model.trainable_variables], ctx.hparams,
                                  continuous=not ctx.spaces.discrete, n_outputs=ctx.spaces.n_actions)

    def collect(self) -> Mapping[str, np.ndarray]:
        seg, moments = self.segment()
        log_std = self.policy.log_std if self.policy.continuous else None
        grads, losses = self.grads.compute(seg.flat(), log_std)
        return {**{f"g/{k}": v for k, v in grads.items()},
                "losses": np.asarray([losses[k] for k in LOSS_NAMES], np.float32), **moments}


class A3CLearnerRole(ActorCriticLearner):
    def __init__(self, ctx: LearnerContext) -> None:
        super().__init__(ctx)
        from worker.algorithms.a3c_grads import A3CLearner

        names = {id(v): n for n, v in ctx.variables.items()}
        self.impl = A3CLearner(ctx.model, [names[id(v)] for v in ctx.model.trainable_variables], ctx.hparams,
                               **self.shape_args())

    def update(self, payloads: Sequence[Payload]) -> Mapping[str, float]:
        lr = self.impl.set_progress(self.ctx.progress())
        stats: dict[str, float] = {}
        for p in payloads:  # one per update (asynchronous), but any number is well defined
            norm = self.impl.apply({k[2:]: v for k, v in p.items() if k.startswith("g/")})
            stats = {**dict(zip(LOSS_NAMES, (float(x) for x in p["losses"]))), "grad_norm": norm}
        return {**stats, "lr": lr}


class A3C(ActorCritic):
    """Asynchronous advantage actor-critic (``--algo a3c``)."""

    name = "a3c"
    hparams = tables.DECLARED["a3c"]
    checkpoint_every = 500  # an update per gradient: small and frequent
    actor = A3CActor
    learner = A3CLearnerRole

    def schedule(self) -> Schedule:
        return Schedule.asynchronous(max_lag=int(self.hp["max_staleness"]))

    def payload(self, weights: Mapping[str, tuple[int, ...]], trainable: Sequence[str]) -> Mapping[str, Field]:
        grads = {f"g/{n}": Field("float32", weights[n], rows=False) for n in trainable}
        if not self.spaces.discrete:
            grads[f"g/{LOG_STD}"] = Field("float32", (self.spaces.n_actions,), rows=False)
        return {**grads, "losses": Field("float32", (len(LOSS_NAMES),), rows=False), **self.moments_schema()}
