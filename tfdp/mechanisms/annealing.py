"""SA-DPSGD's annealing acceptance (seed 000, Algorithm 2) as plain TensorFlow.

After a DP-SGD step proposes candidate weights w_new, SA-DPSGD compares the
energy (mean loss on a PUBLIC energy set) of w_new with that of the current
weights w_t: dE = J(w_new) - J(w_t). The candidate is accepted with
probability P = 1 if dE <= 0 else exp(-dE * Q), or unconditionally when the
previous `rejection_threshold` (mu0) candidates were all rejected. The
temperature Q starts at Q0 (Algorithm 2, line 1) and after every candidate
becomes Q0 * tau, tau the number of accepted candidates so far (line 22).
See docs/mechanisms/sadpsgd.md.

Every function here is branch-free (tf.where, no Python `if` on tensors), so
it runs inside a compiled train step. The decision reads only the released
noisy candidate, public data and its own uniform draw: it is post-processing.

Example:

>>> import tensorflow as tf
>>> float(acceptance_probability(tf.constant(-0.5), tf.constant(10.0)))
1.0
>>> round(float(acceptance_probability(tf.constant(0.1), tf.constant(10.0))), 4)
0.3679
"""

import collections

import tensorflow as tf

from tfdp.mechanisms.gaussian import fold_seed

# Constants folded into a step's seed for the annealing's own random draws.
# Large, so they never coincide with the per-tensor indices (0, 1, ...) that
# DP-SGD's noise folds into the same step seed.
DECISION_STREAM = 0x5AD95A1
SUBSET_STREAM = 0x5AD95A2

AnnealingStep = collections.namedtuple(
    "AnnealingStep",
    [
        "accepted",  # bool: the candidate becomes the new current point
        "forced",  # bool: accepted only because mu reached the threshold
        "probability",  # float: P = min(1, exp(-dE * Q))
        "energy",  # float: the current energy after the decision
        "accepted_count",  # int: tau after the decision
        "consecutive_rejections",  # int: mu after the decision
        "temperature",  # float: Q0 * tau, the temperature of the next step
    ],
)


def acceptance_probability(energy_change, temperature):
    """P = 1 if dE <= 0 else exp(-dE * Q) (the paper's Eq. 3).

    A NaN energy change gives NaN, which no uniform draw is <= to: a candidate
    whose energy cannot be computed is never accepted by chance.

    Args:
        energy_change: float tensor, dE = J(w_new) - J(w_t).
        temperature: float tensor >= 0, Q.

    Returns:
        Float tensor in [0, 1] (or NaN for a NaN dE), shaped like the inputs.

    Example:

    >>> round(float(acceptance_probability(tf.constant(0.2), tf.constant(5.0))), 4)
    0.3679
    """
    energy_change = tf.convert_to_tensor(energy_change, tf.float32)
    temperature = tf.cast(temperature, tf.float32)
    # Multiply only the positive part: dE <= 0 must give exactly 1, and
    # Q = 0 with dE = +inf must not give exp(nan).
    raised = tf.where(energy_change > 0.0, energy_change, tf.zeros_like(energy_change))
    exponent = tf.where(raised > 0.0, -raised * temperature, tf.zeros_like(raised))
    probability = tf.exp(exponent)
    return tf.where(tf.math.is_nan(energy_change), energy_change, probability)


def decision_uniform(step_seed):
    """The step's U(0, 1) draw for the accept decision.

    Args:
        step_seed: int64 tensor [2], the step's seed (see
            `tfdp.mechanisms.dpsgd.step_seed`); it is folded with a constant
            of its own, so the draw is independent of the step's noise.

    Returns:
        Float32 scalar in [0, 1).

    Example:

    >>> u = decision_uniform(tf.constant([3, 4], tf.int64))
    >>> 0.0 <= float(u) < 1.0
    True
    """
    seed = fold_seed(step_seed, DECISION_STREAM)
    return tf.random.stateless_uniform([], seed=seed, dtype=tf.float32)


def subset_indices(step_seed, num_examples, subset_size):
    """`subset_size` distinct indices in [0, num_examples), drawn per step.

    Args:
        step_seed: int64 tensor [2], the step's seed.
        num_examples: int scalar tensor, the size M of the energy set.
        subset_size: Python int k <= M.

    Returns:
        Int32 tensor [k].

    Example:

    >>> idx = subset_indices(tf.constant([1, 2], tf.int64), 10, 4)
    >>> sorted(set(idx.numpy().tolist())) == sorted(idx.numpy().tolist())
    True
    """
    seed = fold_seed(step_seed, SUBSET_STREAM)
    keys = tf.random.stateless_uniform(tf.reshape(num_examples, [1]), seed=seed)
    return tf.math.top_k(keys, k=subset_size, sorted=False).indices


def annealing_step(
    current_energy,
    candidate_energy,
    temperature,
    accepted_count,
    consecutive_rejections,
    uniform,
    initial_temperature,
    rejection_threshold,
):
    """One accept/reject decision and the state update (Algorithm 2, lines 11-22).

    Accept if `uniform <= P` or `consecutive_rejections >= rejection_threshold`
    (forced acceptance; tfdp never forces a candidate whose energy is not
    finite, since its weights have diverged). On acceptance tau += 1 and
    mu = 0, else mu += 1. Then Q = Q0 * tau.

    Args:
        current_energy: float scalar, J(w_t).
        candidate_energy: float scalar, J(w_new).
        temperature: float scalar, Q for this step.
        accepted_count: int scalar, tau before this step.
        consecutive_rejections: int scalar, mu before this step.
        uniform: float scalar, a U(0, 1) draw (`decision_uniform`).
        initial_temperature: Q0 > 0.
        rejection_threshold: mu0 >= 1.

    Returns:
        `AnnealingStep` of scalar tensors.

    Example:

    >>> s = annealing_step(1.0, 1.1, 10.0, tf.constant(3, tf.int64),
    ...                    tf.constant(0, tf.int64), 0.9, 10.0, 10)
    >>> bool(s.accepted), int(s.consecutive_rejections), float(s.energy)
    (False, 1, 1.0)
    """
    current_energy = tf.cast(current_energy, tf.float32)
    candidate_energy = tf.cast(candidate_energy, tf.float32)
    accepted_count = tf.convert_to_tensor(accepted_count)
    consecutive_rejections = tf.convert_to_tensor(consecutive_rejections)
    probability = acceptance_probability(candidate_energy - current_energy, temperature)
    by_chance = tf.cast(uniform, tf.float32) <= probability
    at_threshold = consecutive_rejections >= tf.cast(
        rejection_threshold, consecutive_rejections.dtype
    )
    forced = tf.logical_and(
        tf.logical_and(at_threshold, tf.logical_not(by_chance)),
        tf.math.is_finite(candidate_energy),
    )
    accepted = tf.logical_or(by_chance, forced)
    new_count = accepted_count + tf.cast(accepted, accepted_count.dtype)
    new_rejections = tf.where(
        accepted, tf.zeros_like(consecutive_rejections), consecutive_rejections + 1
    )
    return AnnealingStep(
        accepted=accepted,
        forced=forced,
        probability=probability,
        energy=tf.where(accepted, candidate_energy, current_energy),
        accepted_count=new_count,
        consecutive_rejections=new_rejections,
        temperature=tf.cast(initial_temperature, tf.float32) * tf.cast(new_count, tf.float32),
    )
