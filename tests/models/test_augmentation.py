"""Augmentation multiplicity: fit(augment=fn, augmentations=k).

Each sampled example becomes k augmented copies whose gradients are averaged
before clipping, as one unit (tfdp.models.augmentation). The tests check the
update against a reference computed copy by copy, the bound with a crafted
record whose copies have huge gradients (with a negative control: the same
copies as separate units exceed it), that one example's augmentation does
not depend on the other examples, the ledger, and the refusals.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.auditing.neighbour_step import NeighbourStep
from tfdp.models.augmentation import Augmentation, check_augmentation, step_key

CLIP = 0.5
LR = 1.0


class NoiselessDPSGD(tfdp.optimizers.DPSGD):
    """DPSGD without noise: the update is -lr * clipped sum / b, exactly."""

    def noise_stddev(self):
        return 0.0


def make_model(noiseless=True, **compile_kwargs):
    keras.utils.set_random_seed(0)
    model = tfdp.DPSequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"),
                               keras.layers.Dense(3)])
    cls = NoiselessDPSGD if noiseless else tfdp.optimizers.DPSGD
    model.compile(optimizer=cls(LR, l2_norm_clip=CLIP, noise_multiplier=1.0, seed=1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  **compile_kwargs)
    return model


def data(n=8, seed=0, scale=2.0):
    rng = np.random.default_rng(seed)
    return (scale * rng.normal(size=(n, 6))).astype("float32"), rng.integers(0, 3, n)


def shift_and_flip(x, seed):
    """A random sign and a random shift of the features, from the seed."""
    sign = tf.where(tf.random.stateless_uniform([], seed) < 0.5, -1.0, 1.0)
    shift = tf.random.stateless_uniform([], tf.random.experimental.stateless_fold_in(seed, 1),
                                        minval=0, maxval=6, dtype=tf.int32)
    return sign * tf.roll(x, shift, axis=0)


def weights(model):
    return [v.numpy().copy() for v in model.trainable_variables]


def one_step(model, x, y, **fit_kwargs):
    """Every record drawn (q = 1), one step; returns the weights' change."""
    before = weights(model)
    model.fit(x, y, batch_size=len(x), steps_per_epoch=1, verbose=0, **fit_kwargs)
    return [a - b for a, b in zip(weights(model), before)]


def test_one_copy_equals_training_without_augmentation():
    x, y = data()
    plain = one_step(make_model(noiseless=False), x, y)
    one_copy = one_step(make_model(noiseless=False), x, y, augment=lambda x, seed: x,
                        augmentations=1)
    for p, o in zip(plain, one_copy):
        np.testing.assert_allclose(o, p, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("physical_batch_size, jit", [(None, False), (2, True)])
def test_update_is_the_clipped_mean_of_each_examples_copies(physical_batch_size, jit):
    k = 3
    x, y = data(5)
    model = make_model(jit_compile=jit)
    before = weights(model)
    change = one_step(model, x, y, augment=shift_and_flip, augmentations=k,
                      physical_batch_size=physical_batch_size)
    # The step's augmentation key, as the step read it: the model's step count
    # already advanced by the step's charge (1), the iteration count not yet (0).
    model._dp_steps.assign(1)
    model.optimizer.iterations.assign(0)
    # Compiled as the step was (XLA draws other stateless numbers than TF's kernels).
    key = tf.function(lambda: step_key(model.optimizer), jit_compile=jit)()
    for v, b in zip(model.trainable_variables, before):
        v.assign(b)
    expand = tf.function(Augmentation(shift_and_flip, k, True).expand, jit_compile=jit)
    copies = expand(tf.constant(x), tf.constant(y), tf.ones([len(x)]), tf.ones([len(x)]), key,
                    vectorized=not jit)[0].numpy()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    for i in range(len(x)):
        per_copy = []
        for j in range(k):  # one copy at a time
            with tf.GradientTape() as tape:
                value = loss(y[i:i + 1], model(copies[i * k + j][None]))
            per_copy.append([g.numpy() for g in tape.gradient(value, model.trainable_variables)])
        mean = [np.mean(gs, axis=0) for gs in zip(*per_copy)]
        norm = np.sqrt(sum(np.sum(np.square(g.astype(np.float64))) for g in mean))
        total = [t + min(1.0, CLIP / norm) * g for t, g in zip(total, mean)]
    for c, t in zip(change, total):
        np.testing.assert_allclose(c, -LR * t / len(x), rtol=2e-4, atol=2e-7)
    # The copies differ (two of one example can coincide by chance: a draw of
    # the same shift and flip), so count the distinct ones.
    assert len({c.tobytes() for c in copies}) > len(x)


def huge_copies(x, seed):
    """Copies whose size is drawn from the seed up to 1e6 times the input."""
    return x * (1.0 + 1e6 * tf.random.stateless_uniform([], seed))


CRAFTED = (np.full(6, 1e4, "float32"), np.array(2))


@pytest.mark.xdist_group("augmentation_four_units")  # one worker: the control runs once
@pytest.mark.parametrize("examples_per_user", [None, 2])
def test_a_crafted_examples_copies_move_the_update_by_at_most_the_bound(examples_per_user,
                                                                        four_units_ratio):
    x, y = data(6)
    model = make_model()
    model._augmentation = check_augmentation(huge_copies, 4, x[:1], model.optimizer)
    crafted = CRAFTED
    with NeighbourStep(model, (x, y), records=4, batch_size=5, physical_batch_size=None,
                       examples_per_user=examples_per_user) as step:
        for relation in ("add", "replace"):
            ratio = step.ratio(crafted, relation)
            assert 0.5 < ratio <= 1 + 1e-5, (relation, ratio)
    # Negative control: the same four copies clipped as four units move it 4x.
    assert four_units_ratio > 3.9


@pytest.fixture(scope="module")
def four_units_ratio():
    """The negative control of the test above, the same for both of its
    parametrizations (record level, no augmentation: computed once): the
    crafted record's four copies clipped as four units, over the bound."""
    x, y = data(6)
    model = make_model()
    crafted = CRAFTED
    with NeighbourStep(model, (x, y), records=4, batch_size=5, physical_batch_size=None) as step:
        key = tf.constant([5, 7], tf.int64)
        rows = [step.as_data((r, l)) for r, l in zip(x[:4], y[:4])]
        copies = Augmentation(huge_copies, 4, True).expand(
            tf.constant(np.stack([crafted[0]])), tf.zeros([1]), tf.ones([1]), tf.ones([1]),
            key)[0].numpy()
        with_copies = rows + [(c, crafted[1]) for c in copies]
        base = step.update(rows + rows[:1] * 4, [1] * 4 + [0] * 4)
        added = step.update(with_copies, [1] * 8)
        return np.linalg.norm(added - base) / step.bound


def test_an_examples_copies_do_not_depend_on_the_other_examples():
    aug = Augmentation(shift_and_flip, 3, True)
    key = tf.constant([11, -4], tf.int64)
    x, _ = data(5)
    other = data(5, seed=9)[0]

    def copies(rows):
        batch = tf.constant(np.stack(rows))
        out = aug.expand(batch, tf.zeros([len(rows)]), tf.ones([len(rows)]),
                         tf.ones([len(rows)]), key)[0].numpy()
        return out.reshape(len(rows), 3, -1)

    base = copies(list(x))
    replaced = copies([x[0], other[1], x[2], x[3], x[4]])  # example 1 replaced
    removed = copies([x[0], x[2], x[3], x[4]])             # example 1 removed
    added = copies([other[0]] + list(x))                   # one added in front
    np.testing.assert_array_equal(replaced[[0, 2, 3, 4]], base[[0, 2, 3, 4]])
    np.testing.assert_array_equal(removed, base[[0, 2, 3, 4]])
    np.testing.assert_array_equal(added[1:], base)
    # Negative control: seeds keyed by position (a batch-wide draw) change
    # the later examples' copies when example 1 is removed.
    def by_position(rows):
        seeds = tf.random.stateless_uniform([len(rows), 2], key, minval=None, maxval=None,
                                            dtype=tf.int64)
        return np.stack([shift_and_flip(tf.constant(r), s).numpy() for r, s in zip(rows, seeds)])
    assert not np.array_equal(by_position([x[0], x[2], x[3], x[4]]),
                              by_position(list(x))[[0, 2, 3, 4]])


def test_the_ledger_is_plain_dp_sgds():
    x, y = data(40)
    plain, augmented = make_model(noiseless=False), make_model(noiseless=False)
    plain.fit(x, y, batch_size=8, epochs=2, verbose=0)
    augmented.fit(x, y, batch_size=8, epochs=2, verbose=0, augment=shift_and_flip,
                  augmentations=4)
    assert augmented.privacy.steps == plain.privacy.steps == 10
    assert augmented.privacy.relation == plain.privacy.relation == "add_or_remove"
    assert augmented.privacy.epsilon(1e-5) == plain.privacy.epsilon(1e-5)


def stateful(x, seed):
    return x * tf.random.uniform([])


class Counter(keras.layers.Layer):
    pass


def asserting(x, seed):
    """A data-dependent check: it would abort the step on one record."""
    tf.debugging.assert_less(x[0], 100.0)
    return shift_and_flip(x, seed)


@pytest.mark.parametrize("augment, augmentations, match", [
    (shift_and_flip, 0, "Received: augmentations=0"),
    (shift_and_flip, True, "Received: augmentations=True"),
    (shift_and_flip, 2.0, "Received: augmentations=2.0"),
    (None, 3, "Received: augmentations=3 and augment=None"),
    (lambda x: x, 3, "identical.*augmentations=3"),
    (stateful, 2, r"stateless.*\(RandomUniform\)"),
    (asserting, 2, r"must not assert on its input.*\(Assert\)"),
    (lambda x, seed: x[:3], 2, "shaped as its input"),
    (lambda x, seed: tf.ensure_shape(tf.boolean_mask(x, x < 1e20), [6]), 2,
     r"static shape.*\(Where\)"),
    (lambda x, seed: tf.reshape(tf.boolean_mask(x, x < 1e20), [6]), 2,
     r"static shape.*\(Where\)"),
    (lambda x, seed: tf.cast(x, tf.float64), 2, "shaped as its input"),
    (Counter(), 2, "Keras layer"),
    ("flip", 2, "not callable"),
    (lambda x, seed, other: x, 2, r"parameters \['x', 'seed', 'other'\]"),
])
def test_bad_augment_or_augmentations_are_refused_before_training(augment, augmentations, match):
    x, y = data()
    model = make_model()
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=4, augment=augment, augmentations=augmentations, verbose=0)
    assert model.privacy.steps == 0


def test_an_optimizer_with_its_own_privatize_is_refused():
    class OwnPrivatize(tfdp.optimizers.DPSGD):
        def privatize(self, per_example, step_info):
            return super().privatize(per_example, step_info)

    optimizer = OwnPrivatize(0.1, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="OwnPrivatize cannot average augmented copies"):
        check_augmentation(shift_and_flip, 2, np.zeros((1, 6), "float32"), optimizer)


def test_the_checked_trace_is_the_one_that_runs():
    """A two-faced fn (pure in the two traces `check_augmentation` makes,
    Python afterwards) never runs its second face: the step calls the trace
    `check_augmentation` checked."""
    leaked, calls = [], []

    def two_faced(x, seed):
        calls.append(1)
        if len(calls) <= 2:
            return shift_and_flip(x, seed)
        out = tf.py_function(lambda t: (leaked.append(t.numpy().copy()), t)[1], [x], tf.float32)
        return tf.ensure_shape(out, x.shape)

    x, y = data(8)
    model = make_model()
    model.fit(x, y, batch_size=4, steps_per_epoch=2, augment=two_faced, augmentations=2,
              verbose=0)
    assert model.privacy.steps == 2
    assert leaked == [] and len(calls) == 2
    # Negative control: traced again, the second face runs Python (refused).
    with pytest.raises(ValueError, match=r"EagerPyFunc"):
        check_augmentation(two_faced, 2, x[:1], model.optimizer)


def test_a_shape_check_is_not_a_data_dependent_assert():
    """stateless_random_crop asserts on static shapes only: the same outcome
    for every example, so it is accepted (assert_less on a value is not)."""

    def crop(image, seed):
        padded = tf.pad(image, [[2, 2], [2, 2], [0, 0]])
        return tf.image.stateless_random_crop(padded, tf.shape(image), seed)

    optimizer = tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0)
    assert check_augmentation(crop, 2, np.zeros((1, 8, 8, 1), "float32"), optimizer)
    with pytest.raises(ValueError, match="must not assert on its input"):
        check_augmentation(asserting, 2, np.zeros((1, 6), "float32"), optimizer)


def guide_augment(image, seed):
    """docs/guides/augmentation.md's fn: flip, reflect-pad, crop."""
    image = tf.image.stateless_random_flip_left_right(image, seed)
    padded = tf.pad(image, [[2, 2], [2, 2], [0, 0]], mode="REFLECT")
    crop_seed = tf.random.experimental.stateless_fold_in(seed, 1)
    return tf.image.stateless_random_crop(padded, tf.shape(image), crop_seed)


def test_ops_with_data_dependent_shapes_are_refused():
    """A run-time shape check on a data-dependent shape fails only on some
    records (tf.ensure_shape or tf.reshape of a boolean mask): whether
    training stopped would tell a record, so every tensor of fn's trace
    (nested bodies too) must have a static shape. The guide's crop/flip fn,
    static throughout, is accepted (negative control)."""
    optimizer = tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0)
    images = np.zeros((1, 8, 8, 1), "float32")
    assert check_augmentation(guide_augment, 2, images, optimizer)
    # A loop's TensorList (a variant: no static shape of its own) is not refused.
    rows = lambda x, seed: tf.map_fn(lambda row: row * 2.0, x)  # noqa: E731
    assert check_augmentation(rows, 2, images, optimizer)

    def masked_in_a_branch(x, seed):
        return tf.cond(seed[0] > 0, lambda: tf.reshape(tf.boolean_mask(x, x < 1e20), [6]),
                       lambda: x)

    def unique(x, seed):
        return tf.ensure_shape(tf.cast(tf.unique(tf.cast(x, tf.int32))[0], tf.float32), [6])

    def sliced(x, seed):  # a length read from the values
        length = tf.cast(x[0] < 1e20, tf.int32) + 5
        return tf.ensure_shape(tf.pad(tf.slice(x, [0], [length]), [[0, 1]])[:6], [6])

    for fn, op in [(masked_in_a_branch, "Where"), (unique, "Unique"), (sliced, "Slice")]:
        with pytest.raises(ValueError, match=rf"static shape.*\({op}\)"):
            check_augmentation(fn, 2, np.zeros((1, 6), "float32"), optimizer)
