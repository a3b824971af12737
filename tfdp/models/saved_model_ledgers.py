"""A SavedModel of DP-trained variables keeps the ledger they carry.

`DPModel.export`, a plain Keras `Model.export` (of a DP model's trained
encoder, say), `keras.export.ExportArchive.write_out` and
`tf.saved_model.save` all write a SavedModel, and no ledger of a DP model
travels in it. Read back as `keras.layers.TFSMLayer(path)` (the docs'
export route) inside a DP model trained on the same people, the next
model's statement left out the training its weights had.

tfdp hooks TensorFlow's SavedModel writer and reader (`install`, at
import): when a SavedModel is written, every object it holds (variables, a
Keras model's layers) is looked up in `tfdp.models.weight_ledgers`; if they
carry trainings, the SavedModel gets a ledger that carries them
(`weight_ledgers.carrier_ledger_of`: no releases of its own, the trainings
with their identity, so a model holding a shared prefix does not charge it
twice), as the file `assets.extra/tfdp_carried_ledger.json` beside
`saved_model.pb`, sealed with its SHA-256 (`tfdp.accounting.integrity`),
written before TensorFlow writes the SavedModel's own files. TensorFlow
ignores that directory, so a SavedModel loads and serves as before. A
SavedModel of weights that carry nothing gets no ledger (and loses one an
earlier export left in the same directory).

When `tf.saved_model.load` (and so `keras.layers.TFSMLayer`) reads a
SavedModel with a ledger, the loaded object and its variables carry those
trainings; a `TFSMLayer` and its weights (its own Keras variables around
the loaded ones) carry them too, so a DP model built on it charges them,
trainable or not. A damaged ledger is refused before the SavedModel loads.

Not covered, as for a `.weights.h5` file whose ledger dataset is removed: a
SavedModel whose ledger file is deleted (or copied without `assets.extra`)
loads as never trained. A loaded SavedModel that a DP model uses other
than as a `TFSMLayer` (a custom layer's attribute, a `Lambda` calling it)
is not among its weights, so the model cannot see what it carries.

Example:

>>> import keras, numpy as np, tfdp, tempfile, os
>>> x, y = np.ones((8, 2), "float32"), np.zeros(8, "int32")
>>> def trained(model):
...     model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0,
...                   noise_multiplier=1.0), loss="sparse_categorical_crossentropy")
...     model.fit(x, y, batch_size=4, steps_per_epoch=1, verbose=0)
...     return model
>>> encoder = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)], name="encoder")
>>> _ = trained(tfdp.DPSequential([keras.Input((2,)), encoder, keras.layers.Dense(2)], name="dp"))
>>> path = os.path.join(tempfile.mkdtemp(), "encoder")
>>> encoder.export(path, verbose=False)            # plain Keras, a SavedModel
>>> layer = keras.layers.TFSMLayer(path, call_endpoint="serve")
>>> holder = tfdp.DPSequential([keras.Input((2,)), layer, keras.layers.Dense(2)])
>>> [c.label for c in holder.privacy.carried.values()]
["model 'dp'"]
"""

import functools
import inspect
import os
import threading

import tensorflow as tf
from keras.src.export import tfsm_layer
from tensorflow.python.saved_model import load as tf_load
from tensorflow.python.saved_model import save as tf_save

from tfdp.accounting import PrivacyLedger
from tfdp.models import weight_ledgers

DIRECTORY = "assets.extra"  # TensorFlow's place for files beside a SavedModel it does not read
FILENAME = "tfdp_carried_ledger.json"

_saving = threading.local()  # .dirs: the export directories of the saves in progress


def ledger_path(export_dir):
    """Where the SavedModel in `export_dir` keeps the ledger its weights carry."""
    return os.path.join(os.fsdecode(export_dir), DIRECTORY, FILENAME)


def write(export_dir, saved_objects):
    """Before TensorFlow writes a SavedModel of `saved_objects` into
    `export_dir`: writes the ledger they carry, if any (else removes one an
    earlier save left there).

    Raises:
        ValueError: if they hold both user-level and record-level trainings
            (`PrivacyLedger.carry`); nothing is written then.
    """
    ledger = weight_ledgers.carrier_ledger_of(saved_objects)
    path = ledger_path(export_dir)
    if ledger is None:
        if tf.io.gfile.exists(path):
            tf.io.gfile.remove(path)
        return
    tf.io.gfile.makedirs(os.path.dirname(path))
    with tf.io.gfile.GFile(path, "w") as file:
        file.write(ledger.to_json())


def read(export_dir):
    """The ledger the SavedModel in `export_dir` keeps, or None.

    Raises:
        ValueError: if it is damaged (its seal does not match).
    """
    path = ledger_path(export_dir)
    if not tf.io.gfile.exists(path):
        return None
    with tf.io.gfile.GFile(path, "rb") as file:
        text = file.read()
    try:
        return PrivacyLedger.from_json(text)
    except ValueError as error:
        raise ValueError(
            f"The privacy ledger of the SavedModel at {os.fsdecode(export_dir)!r} ({path}) is "
            f"refused: {error} Export the model again from its DP-trained weights.") from None


def _loaded_objects(root):
    """`root` and the variables it holds (a loaded SavedModel's)."""
    view = tf.train.TrackableView(root)
    return [root] + [o for o in view.descendants() if isinstance(o, tf.Variable)]


def install():
    """Wraps TensorFlow's SavedModel writer (`save_and_return_nodes`, which
    `tf.saved_model.save` and Keras's export call, and `_build_meta_graph`,
    which finds the objects saved before any file is written), its reader
    (`load_partial`, which `tf.saved_model.load` calls, also under its
    alias `tf.__internal__.saved_model.load_partial`, which tf_keras calls) and
    `TFSMLayer.__init__`; once."""
    if getattr(tf_save.save_and_return_nodes, "_tfdp_ledgers", False):
        return
    save_nodes = tf_save.save_and_return_nodes
    build_meta_graph = tf_save._build_meta_graph  # pylint: disable=protected-access
    load_partial, tfsm_init = tf_load.load_partial, tfsm_layer.TFSMLayer.__init__

    @functools.wraps(save_nodes)
    def saving(obj, export_dir, *args, **kwargs):
        dirs = _saving.__dict__.setdefault("dirs", [])
        dirs.append(export_dir)
        try:
            return save_nodes(obj, export_dir, *args, **kwargs)
        finally:
            dirs.pop()

    @functools.wraps(build_meta_graph)
    def building(*args, **kwargs):
        result = build_meta_graph(*args, **kwargs)
        dirs = _saving.__dict__.get("dirs")
        if dirs and dirs[-1] is not None:
            write(dirs[-1], result[4])  # (..., saved_nodes, node_paths)
            dirs[-1] = None  # written: once per save
        return result

    @functools.wraps(load_partial)
    def loading(export_dir, *args, **kwargs):
        ledger = read(export_dir)
        loaded = load_partial(export_dir, *args, **kwargs)
        if ledger is not None:
            for root in loaded.values():
                weight_ledgers.note_ledger_of(_loaded_objects(root), ledger)
        return loaded

    @functools.wraps(tfsm_init)
    def tfsm_layer_init(self, *args, **kwargs):
        tfsm_init(self, *args, **kwargs)
        weight_ledgers.carry_as(self._reloaded_obj, [self] + list(self.weights))  # pylint: disable=protected-access

    # Keras reads a layer's arguments with getfullargspec, which sees a signature, not __wrapped__.
    tfsm_layer_init.__signature__ = inspect.signature(tfsm_init)

    saving._tfdp_ledgers = True  # pylint: disable=protected-access
    tf_save.save_and_return_nodes, tf_save._build_meta_graph = saving, building  # pylint: disable=protected-access
    tf_load.load_partial, tfsm_layer.TFSMLayer.__init__ = loading, tfsm_layer_init
    # The same function under its public alias, which other loaders (tf_keras's) bound at import.
    tf.__internal__.saved_model.load_partial = loading


install()
