"""Weights saved by plain Keras keep the ledger they carry.

The common transfer recipe saves a DP-trained feature extractor as a Keras
model of its own (`encoder.save("encoder.keras")`,
`encoder.save_weights("encoder.weights.h5")`, or a `keras.Model` of the
trained model's layers) and builds the next model on it after
`keras.models.load_model` / `load_weights`. Such a model is no DP model, so
no ledger of its own travels in the file, and the next model's statement
left out the training its weights had.

tfdp hooks Keras's saving (`install`, at import, as it registers its Keras
classes): when Keras writes the variables of a model that is not a DP
model, and they carry trainings (`tfdp.models.weight_ledgers`), the file
gets a ledger that carries them (`weight_ledgers.carrier_ledger`: no
releases of its own), as the dataset "/tfdp_carried_ledger" of the weights
HDF5 file (`.weights.h5`, or the `model.weights.h5` inside a `.keras`
zip), sealed with its SHA-256 (`tfdp.accounting.integrity`). Keras reads
only the groups of the layers, so plain Keras still loads the file. When
Keras loads such a file, the loaded model's variables carry those trainings
(`weight_ledgers.note_file_ledger`), so a DP model built on them charges
them. A damaged ledger is refused, as in a DP model's file. Keras's own
groups of such a file (the root and each layer's, not the `vars` groups
Keras reads) and each weight dataset get the attribute "tfdp_ledger"
(`mark`), which a tool that copies groups or datasets with their attributes
(h5py's `copy`) copies with them: a file whose ledger dataset is missing
while a group or weight is marked (deleted with h5py, or the groups or
weights copied into a new file) is refused at load instead of read as never
trained. A tool that copies the arrays alone (`create_dataset(name,
data=item[()])`: a dtype conversion, a merge script) or deletes the marks
leaves nothing to trace, like a copy as arrays (`set_weights`); the docs'
save/load page says so. Sharded and
`.npz` weights have no place for it: saving carried weights in them is
refused, naming the formats that keep the ledger. Nor has Keras's legacy
HDF5 format (a `.h5` / `.hdf5` name for `save` or
`keras.saving.save_model`, written by `legacy_h5_format.save_model_to_hdf5`,
not `_save_state`): such a save of weights that carry a training, and of
any DP model (no loader reads a DP model from it), is refused before the
file is opened (`refuse_legacy_h5`); a `keras.callbacks.ModelCheckpoint`
that would save a DP model so, before fit's first step
(`refuse_legacy_h5_checkpoints`).

Not covered: `tf.train.Checkpoint` (and any copy as arrays: `set_weights`,
`assign`) writes values only; the docs list it with them.

Example:

>>> import keras, numpy as np, tfdp
>>> x, y = np.ones((8, 2), "float32"), np.zeros(8, "int32")
>>> encoder = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)], name="encoder")
>>> model = tfdp.DPSequential([keras.Input((2,)), encoder, keras.layers.Dense(2)], name="dp")
>>> model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
...               loss="sparse_categorical_crossentropy")
>>> _ = model.fit(x, y, batch_size=4, steps_per_epoch=1, verbose=0)
>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "encoder.keras")
>>> encoder.save(path)                            # plain Keras
>>> reused = keras.models.load_model(path)
>>> holder = tfdp.DPSequential([keras.Input((2,)), reused, keras.layers.Dense(2)])
>>> [c.label for c in holder.privacy.carried.values()]
["model 'dp'"]
"""

import functools
import inspect

import h5py
import keras
import numpy as np
from keras.src.legacy.saving import legacy_h5_format
from keras.src.saving import saving_lib

from tfdp.accounting import PrivacyLedger
from tfdp.models import weight_ledgers

DATASET = "tfdp_carried_ledger"
MARK = "tfdp_ledger"
_MARK_TEXT = (f"these weights carry a differentially private training; its privacy ledger is "
              f"the dataset /{DATASET} of this file")


def _is_dp_model(model):
    return hasattr(model, "_privacy_ledger")  # its own file ledger carries them already


def write(model, weights_store):
    """Before Keras writes `model`'s variables into `weights_store`: adds
    the ledger they carry, if any.

    Raises:
        ValueError: if they carry a training and the store is sharded or
            `.npz` (no place for the ledger).
    """
    if weights_store is None or _is_dp_model(model) or not hasattr(model, "_flatten_layers"):
        return
    ledger = weight_ledgers.carrier_ledger(model)
    if ledger is None:
        return
    if type(weights_store) is not saving_lib.H5IOStore:  # pylint: disable=unidiomatic-typecheck
        raise _no_place_for_ledger(
            model, ledger, f"this file format ({type(weights_store).__name__}: sharded or "
            ".npz weights)", "Save them unsharded, as .keras or .weights.h5")
    text = ledger.to_json().encode("utf-8")
    weights_store.h5_file.create_dataset(DATASET, data=np.frombuffer(text, dtype=np.uint8))


def mark(weights_store):
    """After Keras wrote a file to which `write` added a ledger: marks the
    root, each group but the `vars` ones (which Keras reads: it would take
    an attribute there for a weight) and each weight dataset."""
    if not isinstance(weights_store, saving_lib.H5IOStore) or DATASET not in weights_store.h5_file:
        return
    for item in _items(weights_store.h5_file):
        if item.name.rsplit("/", 1)[-1] not in ("vars", DATASET):
            item.attrs[MARK] = _MARK_TEXT


def _items(file):
    """The root and every group and dataset of an HDF5 file."""
    items = [file]
    file.visititems(lambda _, item: items.append(item))
    return items


def refuse_legacy_h5(model, filepath):
    """Before Keras writes `model` in its legacy HDF5 format to `filepath`.

    Raises:
        ValueError: if `model` is a DP model, or its variables carry a
            training (the format has no place for a ledger).
    """
    if _is_dp_model(model):  # no path named: DPModel.save writes to a temporary name
        raise ValueError(
            f"DP model {model.name!r} cannot be saved in Keras's legacy HDF5 format (a file "
            "name ending in .h5 or .hdf5): "
            "that file has no place for its privacy ledger, and neither tfdp.load_model nor "
            "keras.models.load_model reads a DP model back from it. Save it as .keras "
            "(`DPModel.save('model.keras')`) or its weights as .weights.h5 "
            "(`DPModel.save_weights('model.weights.h5')`).")
    if not hasattr(model, "_flatten_layers"):
        return
    ledger = weight_ledgers.carrier_ledger(model)
    if ledger is not None:
        name = getattr(filepath, "filename", filepath)  # a path or an open h5py.File
        raise _no_place_for_ledger(model, ledger, f"Keras's legacy HDF5 format ({name})",
                                   "Save them as .keras or .weights.h5")


def refuse_legacy_h5_checkpoints(model, callbacks):
    """Before `fit`'s first step: a `keras.callbacks.ModelCheckpoint` that
    would save DP model `model` in the legacy HDF5 format (a `.h5` / `.hdf5`
    name, not weights only) is refused with the message of that save, which
    would otherwise come at its first checkpoint, after an epoch's steps.

    Raises:
        ValueError: naming the checkpoint's filepath and the formats to use.
    """
    for callback in callbacks:
        if (isinstance(callback, keras.callbacks.ModelCheckpoint)
                and not callback.save_weights_only
                and str(callback.filepath).endswith((".h5", ".hdf5"))):
            try:
                refuse_legacy_h5(model, callback.filepath)
            except ValueError as error:
                raise ValueError(
                    f"keras.callbacks.ModelCheckpoint(filepath={callback.filepath!r}) would "
                    f"save the model at each checkpoint, and {error} Pass a .keras filepath, "
                    "or save_weights_only=True with a .weights.h5 one.") from None


def _no_place_for_ledger(model, ledger, file_format, save_as):
    """The refusal of a save whose `file_format` cannot hold the carried `ledger`."""
    labels = ", ".join(c.label for c in ledger.carried.values())
    return ValueError(
        f"The weights of {model.name!r} were trained with differential privacy (by "
        f"{labels}), and {file_format} has no place for their privacy ledger, so a model "
        f"built on them would not charge that training. {save_as} (the ledger travels in "
        "the file), or save the DP model itself (`DPModel.save`).")


def read(model, weights_store):
    """After Keras loaded `model`'s variables from `weights_store`: they
    carry the trainings the file's ledger carries."""
    if not isinstance(weights_store, saving_lib.H5IOStore) or not hasattr(model, "_flatten_layers"):
        return
    if DATASET not in weights_store.h5_file:
        if any(MARK in item.attrs for item in _items(weights_store.h5_file)):
            raise ValueError(
                "These weights were saved by tfdp with the privacy ledger of the differentially "
                f"private training they carry (Keras's groups and weights are marked {MARK!r}), "
                f"but the ledger (the dataset /{DATASET}) is missing: it was deleted, or the "
                "groups or weights were copied into another file without it. A model built on "
                "them could not "
                "charge that training. Load the file tfdp wrote, or copy the dataset "
                f"/{DATASET} with the groups.")
        return
    data = bytes(np.asarray(weights_store.h5_file[DATASET][()], dtype=np.uint8))
    try:
        ledger = PrivacyLedger.from_json(data)
    except ValueError as error:
        raise ValueError(
            f"The privacy ledger that these weights carry is refused: {error}") from None
    weight_ledgers.note_file_ledger(model, ledger)


def _root(function, *args, **kwargs):
    """(saveable, weights store) if this call is the outermost (path ""), else None."""
    bound = inspect.signature(function).bind(*args, **kwargs)
    if bound.arguments.get("inner_path") != "":
        return None
    return bound.arguments["saveable"], bound.arguments["weights_store"]


def install():
    """Wraps Keras's `_save_state` and `_load_state` (every save and load
    of `.keras` and `.weights.h5` goes through them), and its legacy
    `save_model_to_hdf5` (every `.h5` model save); once."""
    if getattr(saving_lib._save_state, "_tfdp_ledgers", False):  # pylint: disable=protected-access
        return
    save_state, load_state = saving_lib._save_state, saving_lib._load_state  # pylint: disable=protected-access
    save_legacy_h5 = legacy_h5_format.save_model_to_hdf5

    @functools.wraps(save_state)
    def saving(*args, **kwargs):
        root = _root(save_state, *args, **kwargs)
        if root is not None:
            write(*root)
        result = save_state(*args, **kwargs)
        if root is not None:
            mark(root[1])
        return result

    @functools.wraps(load_state)
    def loading(*args, **kwargs):
        result = load_state(*args, **kwargs)
        root = _root(load_state, *args, **kwargs)
        if root is not None:
            read(*root)
        return result

    @functools.wraps(save_legacy_h5)
    def saving_legacy_h5(model, filepath, *args, **kwargs):
        refuse_legacy_h5(model, filepath)
        return save_legacy_h5(model, filepath, *args, **kwargs)

    saving._tfdp_ledgers = loading._tfdp_ledgers = True  # pylint: disable=protected-access
    saving_lib._save_state, saving_lib._load_state = saving, loading  # pylint: disable=protected-access
    legacy_h5_format.save_model_to_hdf5 = saving_legacy_h5


install()
