"""The whole-model path: `tf.vectorized_map` of an ordinary backward pass.

Each example runs through the model alone (a batch of one), so its gradient
cannot depend on other examples whatever the layers do: the safe last resort
for models the batched pass cannot run (subclassed models, layers outside the
allow-list). It is slower, and some layers do not vectorize (Keras LSTM/GRU).
Its traced graph is checked before it runs: with oneDNN, sequence models
would crash the process on it (`tfdp.per_example.onednn`).

Example:

>>> import keras, tensorflow as tf
>>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
>>> grads, _, _ = vectorized_gradients(
...     model, tf.ones([4, 3]), tf.zeros([4, 2]), tf.ones([4]),
...     lambda y, p: tf.reduce_sum(tf.square(y - p), -1), training=True)
>>> grads.sq_norms().shape
TensorShape([4])
"""

import tensorflow as tf

from tfdp.per_example.grads import MaterializedGrads, PerExampleGradients
from tfdp.per_example.inference_mode import inference_mode_calls
from tfdp.per_example.onednn import vectorized_map


def vectorized_gradients(model, x, y, weights, loss_fn, training):
    """(PerExampleGradients, y_pred, losses) by `tf.vectorized_map`."""
    variables = model.trainable_variables

    def one_example(example):
        x_i, y_i, w_i = tf.nest.map_structure(lambda t: t[None], example)
        with tf.GradientTape() as tape:
            pred = model(x_i, training=training)
            loss = loss_fn(y_i, pred)
            weighted = tf.reduce_sum(loss * w_i)
        grads = tape.gradient(weighted, variables, unconnected_gradients="zero")
        return grads, tf.nest.map_structure(lambda p: p[0], pred), loss[0]

    with inference_mode_calls(model):  # a trainable BatchNormalization only in inference mode
        grads, y_pred, losses = vectorized_map(one_example, (x, y, weights), f"model '{model.name}'")
    parts = [MaterializedGrads(variables, grads)]
    return PerExampleGradients(variables, parts, path="vectorized"), y_pred, losses
