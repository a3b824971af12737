"""A seeded make_dataset draws the same batches in its n-th Keras epoch whatever
ran before in the process, and fresh batches in every epoch.

With the per-iteration number drawn from `Dataset.random(...,
rerandomize_each_iteration=True)`, a plain Keras fit on any tf.data pipeline
earlier in the process changed the batches of every later epoch over a seeded
`make_dataset` (a test that learned from them failed after such a fit, and
workers with different histories would not draw the same global batch).
The check runs in one fresh process, so that what ran before is exactly known:
its first fit over the seeded `make_dataset` is the first thing the process
trains (nothing ran before); then a plain Keras fit on another tf.data
pipeline runs, and the same seeded `make_dataset` fit again must draw the
same batches epoch by epoch. (One process instead of one per case: a fresh
interpreter and TensorFlow import is most of the test's time. The second
fit also runs after a `make_dataset` fit, so a process-wide draw counter,
which the old two-process test could not see, is caught too.)
"""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import keras, numpy as np, tensorflow as tf
    from tfdp.data import PoissonSampler, make_dataset

    def model():
        keras.utils.set_random_seed(0)
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        # learning rate 0: an epoch's mean loss is a fingerprint of its batches
        m.compile(optimizer=keras.optimizers.SGD(0.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m

    rng = np.random.default_rng(0)
    x_plain, y_plain = rng.normal(size=(64, 4)).astype("float32"), rng.integers(0, 2, 64)
    x, y = rng.normal(size=(300, 4)).astype("float32"), rng.integers(0, 2, 300)

    def seeded_losses():
        dataset = make_dataset(PoissonSampler(300, 50, seed=0), (x, y))
        dataset = dataset.map(lambda xy, mask: (xy[0], xy[1], mask))
        return model().fit(dataset, epochs=4, verbose=0).history["loss"]

    alone = seeded_losses()  # the first fit of this fresh process
    model().fit(tf.data.Dataset.from_tensor_slices((x_plain, y_plain)).batch(8), epochs=1, verbose=0)
    print(alone)
    print(seeded_losses())
    """
)


def losses(line):
    return [float(v) for v in line.strip().strip("[]").split(",")]


def test_keras_epochs_over_make_dataset_draw_anew_and_do_not_depend_on_what_ran_before():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    alone, after_a_fit = map(losses, done.stdout.strip().splitlines()[-2:])
    assert len({round(v, 6) for v in alone}) == 4, alone  # no epoch repeats another's draws
    assert after_a_fit == alone
