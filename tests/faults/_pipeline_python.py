"""Child process: which input pipelines of `fit` run Python on tf.data's threads.

Prints one JSON line: for each training-data kind, the op types of the
dataset graph `fit` trained on that call into Python (PyFunc*, EagerPyFunc, GeneratorDataset)
and how many Python calls TensorFlow made into py_funcs during a short fit.
`tf.data.Dataset.from_generator` raises if anything calls it.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import script_ops

import tfdp

PYTHON_OPS = {"PyFunc", "PyFuncStateless", "EagerPyFunc", "GeneratorDataset"}
calls = []
original_call = script_ops.FuncRegistry.__call__


def counting_call(self, *args, **kwargs):
    calls.append(1)
    return original_call(self, *args, **kwargs)


def no_generator(*args, **kwargs):
    raise AssertionError("tf.data.Dataset.from_generator was called")


script_ops.FuncRegistry.__call__ = counting_call
tf.data.Dataset.from_generator = staticmethod(no_generator)


def python_ops(dataset):
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph(  # pylint: disable=protected-access
        external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE).numpy())
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return sorted({node.op for node in nodes} & PYTHON_OPS)


def model_for(optimizer, width=4):
    model = tfdp.DPSequential([keras.Input((width,)), keras.layers.Dense(2)])
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main(workdir):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(60, 4)).astype(np.float32), rng.integers(0, 2, 60)  # 3 steps an epoch
    np.save(os.path.join(workdir, "x.npy"), x)
    dpsgd = lambda: tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0)  # noqa: E731
    kinds = {
        "arrays": (dpsgd, (x, y)),
        "dpis": (lambda: tfdp.optimizers.DPIS(learning_rate=0.1, l2_norm_clip=1.0, target_epsilon=8.0,
                                              epochs=2, sigma_n=5.0), (x, y)),
        "memmap": (dpsgd, (np.load(os.path.join(workdir, "x.npy"), mmap_mode="r"), y)),
        "record_source": (dpsgd, tfdp.data.RecordSource(list(zip(x, y)))),
    }
    report = {}
    for name, (make_optimizer, data) in kinds.items():
        model = model_for(make_optimizer())
        built = []  # the dataset fit trains on, kept for its graph's op types
        make_training_data = model.optimizer.make_training_data

        def keeping(*args, _make=make_training_data, _built=built, **kwargs):
            dataset, steps = _make(*args, **kwargs)
            _built.append(dataset)
            return dataset, steps

        model.optimizer.make_training_data = keeping
        del calls[:]
        fit_data = data if isinstance(data, tuple) else (data,)
        model.fit(*fit_data, batch_size=20, epochs=2, verbose=0)
        (dataset,) = built
        report[name] = {"python_ops": python_ops(dataset), "python_calls": len(calls)}
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
