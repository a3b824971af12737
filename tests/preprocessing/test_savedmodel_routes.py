"""tf.saved_model.save and keras.export.ExportArchive check the released state (review 7, F10).

Both reach a `DPModel` through TensorFlow's SavedModel saver, not through
`DPModel.save` or `export`: a lookup adapted again on the raw data after its
provenance is refused there too, and an adaptation the model holds is
charged to its ledger before the files are written.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import preprocessing

CANARY = 99950
IDS = np.append(np.random.default_rng(0).integers(1, 10, 299), CANARY)


def model_with_lookup(readapt):
    lookup = keras.layers.IntegerLookup(name="lookup", output_mode="one_hot", max_tokens=12,
                                        pad_to_max_tokens=True)
    preprocessing.adapt_privately(lookup, IDS, epsilon=1.0, delta=1e-7)
    if readapt:
        lookup.adapt(IDS)  # raw, after the private adaptation: the canary is in it
    inputs = keras.Input((1,), dtype="int64")
    return tfdp.DPModel(inputs, keras.layers.Dense(2)(lookup(inputs)))


def saved_model(model, path):
    tf.saved_model.save(model, path)


def export_archive(model, path):
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serve", model.call, [tf.TensorSpec((None, 1), tf.int64)])
    archive.write_out(path, verbose=False)


@pytest.mark.parametrize("write", [saved_model, export_archive])
def test_a_lookup_adapted_again_is_refused_by_savedmodel_routes(write, tmp_path):
    path = os.path.join(tmp_path, "out")
    with pytest.raises(ValueError, match="'lookup'.*changed after") as caught:
        write(model_with_lookup(readapt=True), path)
    assert str(CANARY) not in str(caught.value)
    assert not os.path.exists(os.path.join(path, "saved_model.pb"))


def test_savedmodel_route_charges_the_adaptation_it_writes(tmp_path):
    model = model_with_lookup(readapt=False)  # negative control: written, and charged
    saved_model(model, os.path.join(tmp_path, "out"))
    assert [entry["layer"] for entry in model._privacy_ledger.preprocessing] == ["lookup"]
