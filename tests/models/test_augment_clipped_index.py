"""augment's index into a table may come from the example only through a
clip into the table's range (the fifth review's m2): a clip to bounds past
the axis's length, or arithmetic after the clip, still fails on one record
only, and is refused before the first step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp

TABLE = tf.range(10, dtype=tf.float32)


def records():
    x = np.zeros((16, 4), "float32")
    x[0, 0] = 98765.4375
    return x, np.zeros(16, "int64")


def clipped_past_the_table(x, seed):
    return x + tf.gather(TABLE, tf.clip_by_value(tf.cast(x[0], tf.int32), 0, 100000))


def shifted_after_the_clip(x, seed):
    return x + tf.gather(TABLE, tf.clip_by_value(tf.cast(x[0], tf.int32), 0, 9) + 1000)


def clipped_into_the_table(x, seed):
    return x + tf.gather(TABLE, tf.clip_by_value(tf.cast(x[0], tf.int32), 0, 9))


def model():
    keras.utils.set_random_seed(0)
    dp = tfdp.DPSequential([keras.Input((4,)), keras.layers.Dense(3)])
    dp.compile(optimizer=tfdp.optimizers.DPSGD(0.1, noise_multiplier=1.0, l2_norm_clip=1.0,
                                               seed=1),
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return dp


@pytest.mark.parametrize("augment", [clipped_past_the_table, shifted_after_the_clip])
def test_an_index_clipped_out_of_range_is_refused(augment):
    """Trained on main (any constant bounds were accepted, anywhere upstream)."""
    dp = model()
    x, y = records()
    with pytest.raises(ValueError, match=r"augment must not index by the example's values"):
        dp.fit(x, y, batch_size=8, epochs=1, verbose=0, augment=augment, augmentations=2)
    assert dp.privacy.steps == 0


def test_an_index_clipped_into_the_table_trains():
    """Negative control."""
    dp = model()
    x, y = records()
    dp.fit(x, y, batch_size=8, epochs=1, verbose=0, augment=clipped_into_the_table,
           augmentations=2)
    assert dp.privacy.steps == 2
