"""`SADPSGD`: DP-SGD with simulated-annealing acceptance (seed 000, Algorithm 2).

Each step proposes a DP-SGD candidate (the inner optimizer's update with the
noisy gradient, its slots included), measures its energy (mean loss) on a
PUBLIC energy set, and keeps it with the annealing probability of
`tfdp.mechanisms.annealing`; a rejected candidate is rolled back, weights and
slots alike. docs/mechanisms/sadpsgd.md gives the math and the two soundness
fixes: the energy set must be public, and every candidate is charged to the
privacy ledger (the paper charges accepted ones only; that figure is
available as `paper_claimed_epsilon`, which is not a guarantee).
"""

import numbers

import keras
import numpy as np
import tensorflow as tf

from tfdp import accounting
from tfdp.data import public
from tfdp.data.sources import require_in_memory
from tfdp.mechanisms import annealing
from tfdp.optimizers.dp_optimizer import DPOptimizer, check_positive, noise_multiplier_or_default

MISSING_ENERGY_DATA = (
    "SADPSGD has no public energy set. Call "
    "`optimizer.set_public_energy_data((x_public, y_public))` with data that is "
    "NOT training data (a held-out split you may release, for example); a model "
    "loaded from a file needs this too, since arrays are not saved with the "
    "optimizer's configuration. Training was not started."
)


def _check_energy_batch_size(energy_batch_size):
    if energy_batch_size is None:
        return None
    if isinstance(energy_batch_size, bool) or not isinstance(energy_batch_size, numbers.Integral) or energy_batch_size < 1:
        raise ValueError(
            "Expected `energy_batch_size` to be None (the whole energy set) or an "
            f"int >= 1. Received: energy_batch_size={energy_batch_size!r}"
        )
    return int(energy_batch_size)


class _PublicEnergySet:
    """The energy set in (untracked) variables: read by the compiled step,
    replaceable without retracing, never saved with the model."""

    def __init__(self, x, y, num_examples):
        def variable(array):
            return tf.Variable(
                array, trainable=False, shape=tf.TensorShape([None] + list(array.shape[1:]))
            )

        self.x = tf.nest.map_structure(variable, x)
        self.y = variable(y)
        self.num_examples = num_examples
        self.row_hashes = public.row_hashes(x)
        self.ready = tf.Variable(False, trainable=False)

    def replace(self, x, y, num_examples):
        """Assigns new arrays in place (a compiled step keeps reading these
        variables); per-example shapes must match, dtypes are cast."""
        structure_ok = tf.nest.is_nested(x) == tf.nest.is_nested(self.x) and len(
            tf.nest.flatten(x)
        ) == len(tf.nest.flatten(self.x))
        shapes = [a.shape[1:] for a in tf.nest.flatten((x, y))] if structure_ok else None
        expected = [tuple(v.shape[1:]) for v in tf.nest.flatten((self.x, self.y))]
        if shapes is None or [tuple(s) for s in shapes] != expected:
            raise ValueError(
                "Expected `public_energy_data` with the per-example shapes of the "
                f"energy set already set ({expected}), as the model's inputs and "
                f"labels. Received: shapes {shapes}"
            )
        flat_vars = tf.nest.flatten((self.x, self.y))
        for variable, array in zip(flat_vars, tf.nest.flatten((x, y))):
            variable.assign(np.asarray(array, dtype=variable.dtype.as_numpy_dtype))
        self.num_examples = num_examples
        self.row_hashes = public.row_hashes(x)
        self.ready.assign(False)


@keras.saving.register_keras_serializable(package="tfdp")
class SADPSGD(DPOptimizer):
    """SA-DPSGD: DP-SGD whose candidate updates pass an annealing test.

    Every step: a DP-SGD candidate w_new is computed (clip, noise, inner
    optimizer update); its energy J(w_new), the mean loss of the compiled loss
    on `public_energy_data`, is compared with the current J(w_t); the candidate
    is accepted with probability 1 if dE <= 0 else exp(-dE * Q), and always
    after `rejection_threshold` consecutive rejections. A rejected candidate is
    rolled back: the weights and the inner optimizer's slots (momentum, Adam's
    moments) return bit-for-bit to their previous values. The temperature is
    Q = initial_temperature on the first step, then initial_temperature * tau,
    tau the number of accepted candidates (Algorithm 2, lines 1 and 22; so a
    rejected first step makes Q = 0 and the second step is accepted). The
    inner optimizer's iteration counter is never rolled back: it keys the
    noise, so it counts every candidate (Adam's bias correction sees T, not
    tau). The decision reads only the released noisy candidate, public data and its own
    random draw, so it is post-processing.

    Privacy: every candidate, accepted or not, is a Poisson-sampled Gaussian
    release, and the model depends on the rejected ones through the
    decisions. The model's ledger (`model.privacy`, the `PrivacyBudget`
    callback) charges all T candidates. `paper_claimed_epsilon` gives the
    paper's Theorem 1 figure (tau accepted steps, classic RDP conversion) for
    comparison with its Table 3; it is NOT a differential-privacy guarantee.

    The energy set must be public: it steers every decision without noise.
    Never pass training data (fit refuses an energy set sharing examples with
    the training data, but only exact duplicates: a near-copy such as an
    augmented or rescaled training record is not detected). A held-out split you are free to release is the
    intended use. Cost: one forward pass over the energy set per step (plus
    one at the start of every `fit`); with `energy_batch_size=k`, a fresh
    random subset of k public examples is drawn every step and both energies
    are evaluated on it (2k forward examples per step). The whole set is
    evaluated in one batch, so its activations must fit in memory. Measured
    on 2 CPU cores (benchmarks/sadpsgd_fashion_mnist.py, tanh CNN, batch
    2048, 5,000 public examples): 24.5 s per epoch against DP-SGD's 16.6 s.
    Runs on one replica: `fit` refuses a tf.distribute strategy with several
    replicas (see `multi_replica_unsupported`).

    Logs (each step; the epoch's logs show its last step): "energy" J(w_t)
    after the decision, "candidate_energy" J(w_new), "tau" (accepted so
    far), "mu" (consecutive rejections), "temperature" (Q for the next step),
    "acceptance_rate" (tau / candidates so far).

    Args:
        learning_rate, momentum, nesterov: the SGD inner optimizer's
            arguments, as `tfdp.optimizers.DPSGD` (defaults 0.01, 0, False;
            the paper uses plain SGD).
        l2_norm_clip: clipping bound C > 0.
        noise_multiplier: sigma > 0 (default 1.0; chosen by `fit` with
            `target_epsilon` and `target_delta`, see `DPOptimizer`).
        public_energy_data: required keyword, a pair (x, y) of PUBLIC arrays
            (not training data). `None` defers it to `set_public_energy_data`
            (as `from_config` does: arrays are not part of the configuration).
        initial_temperature: Q0 > 0 (paper: 10).
        rejection_threshold: mu0, an int >= 1 (paper: 10; 5 on CIFAR-10).
        energy_batch_size: None (default, the whole energy set every step)
            or an int k: a random k-subset of it every step.
        inner_optimizer: optional `keras.optimizers.Optimizer` used instead of
            SGD (then leave learning_rate, momentum and nesterov unset).
        weight_decay, weight_decay_placement, seed, name: see `DPOptimizer`.

    Example (SA-DPSGD's Fashion-MNIST settings, Table 2; x_public, y_public a
    public held-out split):

    >>> import numpy as np, tfdp
    >>> x_public = np.zeros((100, 28, 28, 1), np.float32)
    >>> y_public = np.zeros(100, np.int64)
    >>> opt = tfdp.optimizers.SADPSGD(
    ...     learning_rate=4.0, l2_norm_clip=0.1, noise_multiplier=2.15,
    ...     public_energy_data=(x_public, y_public))
    >>> opt.initial_temperature, opt.rejection_threshold
    (10.0, 10)
    """

    _fixed_settings = DPOptimizer._fixed_settings + (
        "initial_temperature",
        "rejection_threshold",
        "energy_batch_size",
    )

    adaptive_clipping_unsupported = (
        "its acceptance test and its analysis assume one fixed clip norm."
    )
    user_level_unsupported = (
        "its acceptance test and its analysis are stated per record, not per person."
    )
    multi_replica_unsupported = (
        "its accept/reject decision and the roll-back of weights and optimizer "
        "slots are one cross-replica decision, which it does not synchronise "
        "(workers keyed from their own entropy would decide differently)."
    )

    def __init__(
        self,
        learning_rate=None,
        momentum=None,
        nesterov=None,
        l2_norm_clip=1.0,
        noise_multiplier=None,
        *,
        public_energy_data,
        initial_temperature=10.0,
        rejection_threshold=10,
        energy_batch_size=None,
        inner_optimizer=None,
        weight_decay=0.0,
        weight_decay_placement="before_clip",
        seed=None,
        name=None,
        **kwargs,
    ):
        sgd_args = {"learning_rate": learning_rate, "momentum": momentum, "nesterov": nesterov}
        if inner_optimizer is None:
            inner_optimizer = keras.optimizers.SGD(
                learning_rate=0.01 if learning_rate is None else learning_rate,
                momentum=momentum or 0.0,
                nesterov=bool(nesterov),
            )
            sgd_inner = True
        else:
            given = sorted(k for k, v in sgd_args.items() if v is not None)
            if given:
                raise ValueError(
                    "Set the learning rate and momentum on `inner_optimizer`, not on "
                    f"SADPSGD. Received: inner_optimizer={type(inner_optimizer).__name__} "
                    f"and {', '.join(f'{k}={sgd_args[k]!r}' for k in given)}"
                )
            sgd_inner = False
        super().__init__(
            inner_optimizer,
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier_or_default(noise_multiplier, kwargs),
            weight_decay=weight_decay,
            weight_decay_placement=weight_decay_placement,
            seed=seed,
            name=name,
            **kwargs,
        )
        self._sgd_inner = sgd_inner
        self.initial_temperature = check_positive("initial_temperature", initial_temperature)
        if isinstance(rejection_threshold, bool) or not isinstance(rejection_threshold, numbers.Integral) or rejection_threshold < 1:
            raise ValueError(
                "Expected `rejection_threshold` to be an int >= 1. "
                f"Received: rejection_threshold={rejection_threshold!r}"
            )
        self.rejection_threshold = int(rejection_threshold)
        self.energy_batch_size = _check_energy_batch_size(energy_batch_size)
        self._energy_set = None
        if public_energy_data is not None:
            self.set_public_energy_data(public_energy_data)

    # -- the public energy set ----------------------------------------------

    def set_public_energy_data(self, public_energy_data):
        """Sets (or replaces) the PUBLIC energy set, a pair (x, y) of arrays.

        Call it on a loaded model before training again: arrays are not saved
        with the optimizer. The current energy is recomputed on the new set at
        the next step. Never pass training data: the energy steers every
        accept decision without noise.

        Args:
            public_energy_data: (x, y), x an array (or nest of arrays for a
                multi-input model) and y the labels, as the compiled loss
                expects them.
        """
        x, y, num = public.public_arrays(public_energy_data, "public_energy_data")
        if self.energy_batch_size is not None and self.energy_batch_size > num:
            raise ValueError(
                f"Expected `energy_batch_size` <= the size of the energy set ({num}). "
                f"Received: energy_batch_size={self.energy_batch_size}"
            )
        if self._energy_set is None:
            with tf.init_scope():
                self._energy_set = _PublicEnergySet(x, y, num)
        else:
            self._energy_set.replace(x, y, num)

    def _require_energy_set(self):
        if self._energy_set is None:
            raise ValueError(MISSING_ENERGY_DATA)
        return self._energy_set

    # -- state ---------------------------------------------------------------

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._tau = self.add_variable((), "zeros", "int64", name="accepted_count")
        self._mu = self.add_variable((), "zeros", "int64", name="consecutive_rejections")
        self._candidates = self.add_variable((), "zeros", "int64", name="candidate_count")
        self._temperature = self.add_variable(
            (), keras.initializers.Constant(self.initial_temperature), "float32", name="temperature"
        )
        self._energy = self.add_variable(
            (), keras.initializers.Constant(float("nan")), "float32", name="energy"
        )
        self._q = self.add_variable((), "zeros", "float64", name="sampling_probability")

    def _check_built(self):
        if not self.built:
            raise ValueError("The optimizer is not built yet: compile a model with it and train.")

    @property
    def accepted_count(self):
        """tau, the number of accepted candidates (a variable)."""
        self._check_built()
        return self._tau

    @property
    def candidate_count(self):
        """T, the number of candidates proposed, i.e. private steps (a variable)."""
        self._check_built()
        return self._candidates

    @property
    def consecutive_rejections(self):
        """mu, rejections since the last acceptance (a variable)."""
        self._check_built()
        return self._mu

    @property
    def temperature(self):
        """Q, the temperature of the next step (a variable)."""
        self._check_built()
        return self._temperature

    @property
    def energy(self):
        """J(w_t), the current weights' energy on the public set (a variable)."""
        self._check_built()
        return self._energy

    def _slot_variables(self):
        """The inner optimizer's state rolled back on rejection.

        Everything but its iteration counter (which keys the noise and must
        count every candidate) and its learning-rate variable (not updated by
        a step).
        """
        inner = self.inner_optimizer
        skip = {id(inner.iterations)}
        rate = getattr(inner, "_learning_rate", None)
        if isinstance(rate, keras.Variable):
            skip.add(id(rate))
        return [v for v in inner.variables if id(v) not in skip]

    # -- the annealing step ----------------------------------------------------

    def _mean_energy(self, model, x, y):
        losses = model._per_example_loss(y, model(x, training=False))
        return tf.reduce_mean(tf.cast(losses, tf.float32))

    def apply_private_gradients(self, grads, trainable_variables, model=None):
        """Candidate update, energy on the public set, accept or roll back.

        Branch-free: runs inside the compiled train step. Returns the logs
        described in the class docstring.
        """
        if model is None or getattr(model, "_per_example_loss", None) is None:
            raise ValueError(
                "SADPSGD evaluates each candidate's loss with the model: call it "
                "from a compiled tfdp.DPModel / DPSequential. Received: model="
                f"{type(model).__name__ if model is not None else None}"
            )
        energy_set = self._require_energy_set()
        trainable_variables = list(trainable_variables)
        step_seed = self.step_key()
        state = trainable_variables + self._slot_variables()
        saved = [tf.identity(tf.convert_to_tensor(v)) for v in state]

        if self.energy_batch_size is None:
            x, y = energy_set.x, energy_set.y
            x = tf.nest.map_structure(tf.convert_to_tensor, x)
            y = tf.convert_to_tensor(y)
            current = tf.cond(
                energy_set.ready,
                lambda: tf.identity(tf.convert_to_tensor(self._energy)),
                lambda: self._mean_energy(model, x, y),
            )
        else:
            index = annealing.subset_indices(
                step_seed, tf.shape(energy_set.y)[0], self.energy_batch_size
            )
            x = tf.nest.map_structure(lambda v: tf.gather(v, index), energy_set.x)
            y = tf.gather(energy_set.y, index)
            current = self._mean_energy(model, x, y)

        self.inner_optimizer.apply(grads, trainable_variables)
        candidate = self._mean_energy(model, x, y)
        step = annealing.annealing_step(
            current_energy=current,
            candidate_energy=candidate,
            temperature=self._temperature,
            accepted_count=tf.convert_to_tensor(self._tau),
            consecutive_rejections=tf.convert_to_tensor(self._mu),
            uniform=annealing.decision_uniform(step_seed),
            initial_temperature=self.initial_temperature,
            rejection_threshold=self.rejection_threshold,
        )
        for variable, before in zip(state, saved):
            variable.assign(tf.where(step.accepted, tf.convert_to_tensor(variable), before))
        self._tau.assign(step.accepted_count)
        self._mu.assign(step.consecutive_rejections)
        self._temperature.assign(step.temperature)
        self._energy.assign(step.energy)
        self._candidates.assign_add(1)
        energy_set.ready.assign(True)
        return {
            "energy": step.energy,
            "candidate_energy": candidate,
            "tau": step.accepted_count,
            "mu": step.consecutive_rejections,
            "temperature": step.temperature,
            "acceptance_rate": tf.cast(step.accepted_count, tf.float32)
            / tf.cast(tf.convert_to_tensor(self._candidates), tf.float32),
        }

    def make_training_data(self, model, arrays, batch_size, steps_per_epoch=None, budgets=()):
        """DP-SGD's Poisson-sampled data, after checking the energy set.

        Refuses to start without a public energy set or with one that shares
        examples with the training data. The current energy is recomputed at
        the first step of every `fit` (the weights may have been changed).
        """
        energy_set = self._require_energy_set()
        require_in_memory(arrays, "SADPSGD", "compares every training record with the energy set")
        public.check_disjoint_from_training_data(
            energy_set.row_hashes, arrays[0], "public_energy_data",
            "The energy set steers every accept decision",
        )
        dataset, steps = super().make_training_data(
            model, arrays, batch_size, steps_per_epoch=steps_per_epoch, budgets=budgets
        )
        if not self.built:
            self.build(model.trainable_variables)
        self._q.assign(batch_size / len(tf.nest.flatten(arrays)[0]))
        energy_set.ready.assign(False)
        return dataset, steps

    # -- the paper's number ----------------------------------------------------

    def paper_claimed_epsilon(self, delta, sampling_probability=None):
        """The paper's epsilon (Theorem 1): NOT a privacy guarantee.

        Charges only the tau accepted candidates, with the classic RDP
        conversion (integer orders 2..64), as the paper's Table 3 does. The
        rejected candidates were released to the decisions too, so this
        under-counts; the guarantee is `model.privacy.epsilon(delta)`, which
        charges every candidate. Use this only to compare with the paper.

        Args:
            delta: target delta in (0, 1).
            sampling_probability: q; default the last `fit`'s batch_size / N.

        Returns:
            The paper-style epsilon (0.0 before any accepted candidate).
        """
        self._check_built()
        if sampling_probability is None:
            sampling_probability = float(self._q.numpy())
            if sampling_probability <= 0.0:
                raise ValueError(
                    "No training ran yet, so the sampling probability is unknown. "
                    "Received: sampling_probability=None"
                )
        return accounting.compute_epsilon(
            self.noise_multiplier,
            sampling_probability,
            int(self._tau.numpy()),
            delta,
            accountant="rdp",
            conversion="classic",
        )

    # -- serialization -----------------------------------------------------------

    def get_config(self):
        config = super().get_config()
        if self._sgd_inner:
            inner = config.pop("inner_optimizer")["config"]
            config.update(
                learning_rate=inner["learning_rate"],
                momentum=inner["momentum"],
                nesterov=inner["nesterov"],
            )
        config.update(
            initial_temperature=self.initial_temperature,
            rejection_threshold=self.rejection_threshold,
            energy_batch_size=self.energy_batch_size,
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds the optimizer without its energy set (arrays are not
        configuration): call `set_public_energy_data` before training."""
        config = {"public_energy_data": None, **config}
        return super().from_config(config, custom_objects=custom_objects)

