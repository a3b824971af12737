"""The step counter's cheap read returns the counter's value, and the
variable's own read wherever the cheap one does not apply."""

import keras
import pytest
import tensorflow as tf

from tfdp.models.counter_reads import read_counter


def test_a_keras_counter_reads_its_value_after_assignments():
    counter = keras.Variable(0, dtype="int64", trainable=False)
    for value in (0, 7, 2**40):
        counter.assign(value)
        assert read_counter(counter) == value


def test_the_cheap_read_does_not_call_numpy(monkeypatch):
    counter = keras.Variable(5, dtype="int64", trainable=False)
    monkeypatch.setattr(type(counter), "numpy", lambda self: pytest.fail("numpy() was called"))
    assert read_counter(counter) == 5


def test_a_mirrored_counter_takes_its_own_read(monkeypatch):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        counter = tf.Variable(4, dtype=tf.int64)
    counter.assign(9)
    calls = []
    original = type(counter).numpy
    monkeypatch.setattr(type(counter), "numpy", lambda self: calls.append(1) or original(self))
    assert read_counter(counter) == 9
    assert calls  # the control: this counter was not read by the cheap path


def test_a_plain_tensorflow_counter_takes_the_cheap_read(monkeypatch):
    """A tf.Variable's `value` is a method, not the variable: the cheap read
    must still apply to it, as its docstring says."""
    counter = tf.Variable(6, dtype=tf.int64)
    monkeypatch.setattr(type(counter), "numpy", lambda self: pytest.fail("numpy() was called"))
    assert read_counter(counter) == 6
