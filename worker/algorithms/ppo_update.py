"""Clipped PPO's update in TensorFlow, master side: the learner that turns queued trajectory segments into new weights.

Segments may come from a policy older than the learner's (collection overlaps learning: a segment is
usually one version behind, see :mod:`worker.group`). The update is decoupled PPO (Hilton et al., 2021,
"Batch size-invariance for policy optimization"), the form APPO-style learners use for policy lag:

* the *proximal* policy is the learner's own at the start of the update; PPO's ratio and its clipping are
  taken against it, so the trust region is the same however old the data is;
* the *behaviour* policy (the log-probabilities the group sent) enters only through an importance weight
  ``min(rho_bar, pi_prox / pi_behaviour)``, truncated as V-trace truncates its rho, so a stale segment
  cannot blow up the step.

With lag 0 (``sync=true``) the proximal and the behaviour policy are the same, the weights are 1 and this
is exactly the classic clipped PPO.

Why one ``tf.function`` call per update: every Python call into TensorFlow costs ~0.4 ms of dispatch, and
an update was 16 minibatch steps plus 6 eager gathers each; profiled on 2 cores that overhead was over
half of the master's time. All epochs and minibatches now run in one graph (a ``tf.range`` loop), with
the minibatch order drawn in numpy and passed in. docs/benchmarks.md has the figures, with and without XLA.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import tensorflow as tf

from worker.algorithms.tfdist import LearnerBase, log_prob_entropy

STAT_NAMES = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac", "grad_norm")
BATCH_KEYS = ("obs", "actions", "logp", "advantages", "returns")
PAD_TO = 256  # with jit_compile, batches are padded to a multiple of this: XLA compiles once per shape


class PPOLearner(LearnerBase):
    """Holds the model and optimiser; :meth:`update` runs ``epochs`` x ``minibatches`` clipped steps.

    ``jit_compile`` (hyper-parameter) compiles the update with XLA: faster per update, but seconds of
    compilation per batch shape, so it pays only on long runs (docs/benchmarks.md).
    """

    def __init__(self, model: Any, hp: Mapping[str, Any], seed: int, **shape: Any) -> None:
        super().__init__(model, hp=hp, **shape)
        self.rng = np.random.default_rng(seed)
        self.jit = bool(self.hp.get("jit_compile", False))
        self._update = self._make_update()
        self.last_is_weight = 1.0  # mean truncated importance weight of the last update (1.0: no lag)
        if not self.jit:
            # Traced now (~1 s), while the groups are still starting, not when the first segments wait for it.
            self._update.get_concrete_function()

    def _make_update(self) -> Any:
        model, opt, variables, hp, cont = self.model, self.optimizer, self.variables, self.hp, self.continuous
        log_std = self.log_std
        clip, vf, ent, max_norm = float(hp["clip"]), float(hp["vf_coef"]), float(hp["ent_coef"]), float(hp["max_grad_norm"])
        rho_bar = float(hp.get("rho_bar", 1.0))

        def step(obs: tf.Tensor, actions: tf.Tensor, prox_logp: tf.Tensor, is_w: tf.Tensor, adv: tf.Tensor,
                 ret: tf.Tensor) -> tf.Tensor:
            # --- algorithm: one clipped, importance-weighted PPO step on a minibatch
            adv = (adv - tf.reduce_mean(adv)) / (tf.math.reduce_std(adv) + 1e-8)
            with tf.GradientTape() as tape:
                out, value = model(obs, training=True)
                value = tf.reshape(value, [-1])  # (B,) or (B, 1): a --model may end in Dense(1)
                logp, entropy = log_prob_entropy(log_std, out, actions, cont)
                log_ratio = logp - prox_logp
                ratio = tf.exp(log_ratio)
                surrogate = tf.minimum(ratio * adv, tf.clip_by_value(ratio, 1 - clip, 1 + clip) * adv)
                pg = -tf.reduce_mean(is_w * surrogate)
                v_loss = 0.5 * tf.reduce_mean(tf.square(ret - value))
                loss = pg + vf * v_loss - ent * entropy
            grads = tape.gradient(loss, variables)
            grads, norm = tf.clip_by_global_norm(grads, max_norm)
            opt.apply_gradients(zip(grads, variables))
            approx_kl = tf.reduce_mean((ratio - 1) - log_ratio)
            clipfrac = tf.reduce_mean(tf.cast(tf.abs(ratio - 1) > clip, tf.float32))
            return tf.stack([pg, v_loss, entropy, approx_kl, clipfrac, norm])

        act_spec = tf.TensorSpec((None, self.n_outputs), tf.float32) if cont else tf.TensorSpec((None,), tf.int64)
        signature = [tf.TensorSpec((None, *self.obs_shape), tf.as_dtype(self.obs_dtype)), act_spec,
                     tf.TensorSpec((None,), tf.float32), tf.TensorSpec((None,), tf.float32),
                     tf.TensorSpec((None,), tf.float32), tf.TensorSpec((None, None), tf.int32), tf.TensorSpec((), tf.int32)]

        # One trace for every batch size (an unknown row count), not a retrace when the size first changes.
        @tf.function(input_signature=signature, jit_compile=self.jit)
        def update(obs: tf.Tensor, actions: tf.Tensor, behaviour_logp: tf.Tensor, adv: tf.Tensor, ret: tf.Tensor,
                   order: tf.Tensor, n_real: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            # The proximal policy (the learner's, now) and the truncated importance weights, once per update.
            out, _ = model(obs, training=False)
            prox = log_prob_entropy(log_std, out, actions, cont)[0]
            is_w = tf.minimum(rho_bar, tf.exp(prox - behaviour_logp))
            total = tf.zeros(len(STAT_NAMES))
            for i in tf.range(tf.shape(order)[0]):  # epochs x minibatches; order[i] holds row indices
                idx = order[i]
                total += step(*(tf.gather(x, idx) for x in (obs, actions, prox, is_w, adv, ret)))
            steps = tf.cast(tf.maximum(tf.shape(order)[0], 1), tf.float32)
            # A mask, not a slice: XLA would compile once per value of n_real for a dynamic slice.
            real = tf.cast(tf.range(tf.shape(is_w)[0]) < n_real, tf.float32)
            return total / steps, tf.reduce_sum(is_w * real) / tf.maximum(tf.reduce_sum(real), 1.0)

        return update

    def minibatch_order(self, n: int, n_rows: int) -> np.ndarray:
        """Row indices, (epochs x minibatches, minibatch size): each epoch a fresh permutation of the ``n``
        real rows; with padding (``n_rows > n``) topped up with a few real rows drawn again, so the shape
        depends on ``n_rows`` alone."""
        epochs, k = int(self.hp["epochs"]), int(self.hp["minibatches"])
        mb = max(1, n_rows // k)
        if epochs == 0:
            return np.zeros((0, mb), np.int32)
        rows = []
        for _ in range(epochs):
            perm = self.rng.permutation(n)
            if n_rows > n:
                perm = np.concatenate([perm, self.rng.integers(0, n, n_rows - n)])
            rows.append(perm[: mb * k].reshape(k, mb))
        return np.concatenate(rows).astype(np.int32)

    def update(self, batch: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Run the PPO epochs on one batch (keys: obs, actions, logp (behaviour), advantages, returns)."""
        if int(self.hp["epochs"]) == 0:  # learning off (the actor benchmark): not even the proximal pass
            return {**dict.fromkeys(STAT_NAMES, 0.0), "is_weight": 1.0}
        n = len(batch["logp"])
        n_rows = -(-n // PAD_TO) * PAD_TO if self.jit else n
        cols = [np.asarray(batch[k]) for k in BATCH_KEYS]
        if not self.continuous:
            cols[1] = cols[1].astype(np.int64, copy=False)
        if n_rows > n:  # padding rows are never in the order; they only fix the compiled shape
            cols = [np.concatenate([c, np.zeros((n_rows - n, *c.shape[1:]), c.dtype)]) for c in cols]
        stats, is_w = self._update(*cols, self.minibatch_order(n, n_rows), np.int32(n))
        self.last_is_weight = float(is_w)
        return {**dict(zip(STAT_NAMES, stats.numpy().tolist())), "is_weight": self.last_is_weight}
