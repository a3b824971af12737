"""A DP fit traces tfdp's per-example pass as Keras traces the step: without
AutoGraph. Keras 3 does not convert its train function
(`tf.autograph.experimental.do_not_convert`); the state-writes check traced
the same pass through AutoGraph, which converted several hundred of tfdp's
and TensorFlow's functions on a process's first fit (about 5 s of a 7.5 s
first fit of a small model on 2 cores) and scanned another program than
the step runs."""

import logging
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp


@pytest.fixture
def converted_calls():
    """Names of the functions AutoGraph converts while the test runs."""
    names = []

    class Handler(logging.Handler):
        def emit(self, record):
            found = re.match(r"Converted call: <function (\S+) at", record.getMessage())
            if found:
                names.append(found.group(1))

    logger = logging.getLogger("tensorflow")
    handler, level = Handler(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    tf.autograph.set_verbosity(3)
    try:
        yield names
    finally:
        tf.autograph.set_verbosity(0)
        logger.setLevel(level)
        logger.removeHandler(handler)


def test_a_dp_fit_converts_no_function_of_the_per_example_pass(converted_calls):
    x = np.random.default_rng(0).normal(size=(64, 5)).astype("float32")
    model = tfdp.DPSequential([keras.Input((5,)), keras.layers.Dense(2)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, np.zeros(64, "int32"), batch_size=32, epochs=1, verbose=0)
    # The control: the log is read (tf.data converts its map functions).
    assert converted_calls
    assert "compute_per_example_gradients" not in converted_calls
    assert not [name for name in converted_calls if "forward_backward" in name]
