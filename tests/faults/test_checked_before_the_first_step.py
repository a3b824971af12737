"""Inputs that used to be found only after steps were charged (issue 35,
items 2 and 7; issue 34, item 6): each is refused before the first step by an
error naming the argument or the record, or trained as the user meant."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.data import ArraySource, RecordSource

N, D, CLASSES = 40, 4, 3
X = np.random.default_rng(0).normal(size=(N, D)).astype(np.float32)
Y = np.arange(N) % CLASSES


def build(with_input=True, seed=0):
    keras.utils.set_random_seed(0)
    layers = ([keras.Input((D,))] if with_input else []) + [keras.layers.Dense(CLASSES)]
    model = tfdp.DPSequential(layers)
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def fit(model, *data, **kwargs):
    data = data or (X, Y)
    return model.fit(*data, batch_size=8, epochs=1, verbose=0, **kwargs)


# -- a loss-scaling inner optimizer -----------------------------------------------------


def test_a_loss_scale_optimizer_inside_a_dp_optimizer_is_refused_by_name():
    """The old code accepted it and divided the DP gradients by the 32,768
    loss scale (mean |dw| 2.0e-6 against 5.5e-2) while charging the full
    epsilon."""
    with pytest.raises(ValueError, match=r"LossScaleOptimizer.*inner_optimizer.inner_optimizer.*"
                       r"Received: inner_optimizer=LossScaleOptimizer\(SGD\)"):
        tfdp.optimizers.DPOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5)), 1.0, 1.0)
    tfdp.optimizers.DPOptimizer(keras.optimizers.SGD(0.5), 1.0, 1.0)  # control: the inner one


# -- validation_data ----------------------------------------------------------------------


@pytest.mark.parametrize("validation_data, match", [
    ((np.zeros((10, D + 1), np.float32), Y[:10]), r"(?s)validation_data.*does not fit the model.*ValueError.*take shapes \[\(None, 4\)\].*shape \(10, 5\)"),
    ((X[:10], np.array(["cat"] * 10)), r"numeric labels.*validation_data.*dtype text"),
    ((X[:10], np.full(10, 9)), r"class indices in \[0, 2\].*validation_data's y with 10 label\(s\) outside that range, the first at index 0"),
    ((X[:10], Y[:10], np.ones((10, 2))), r"validation_data.*sample_weight.*\(10, 2\)"),
    (RecordSource(list(zip(X[:10], Y[:10]))), r"validation_data.*RecordSource.*read_records"),
])
def test_bad_validation_data_is_refused_before_the_first_step(validation_data, match):
    """The old code found each only when validation ran, after an epoch of
    steps was charged."""
    model = build()
    with pytest.raises((ValueError, TypeError), match=match):
        fit(model, validation_data=validation_data)
    assert model.privacy.steps == 0


def test_validation_data_that_fits_still_validates():
    model = build()
    history = fit(model, validation_data=(X[:10], Y[:10]))
    assert "val_loss" in history.history and model.privacy.steps == 5
    on_disk = build()
    history = fit(on_disk, validation_data=ArraySource(X[:10], Y[:10]))
    assert np.isfinite(history.history["val_loss"][0])


# -- labels checked once the model is built -----------------------------------------------


def test_labels_of_a_model_without_an_input_layer_are_checked_once_it_is_built():
    """Without keras.Input the model's outputs are unknown until fit builds
    it; the old code skipped the check and charged a step before TensorFlow
    failed."""
    model = build(with_input=False)
    with pytest.raises(ValueError, match=r"class indices in \[0, 2\].*the first at index 0"):
        fit(model, X, np.full(N, 9))
    assert model.privacy.steps == 0
    fit(build(with_input=False), X, Y)  # control


def test_an_out_of_range_label_is_refused_by_its_position_never_its_value():
    """A label can be a record's own value (a crafted 4711): the old message
    printed the largest label."""
    labels = Y.copy()
    labels[-1] = 4711
    model = build()
    with pytest.raises(ValueError, match=rf"1 label\(s\) outside that range, the first at "
                       rf"index {N - 1}") as caught:
        fit(model, X, labels)
    assert "4711" not in str(caught.value)
    assert model.privacy.steps == 0


# -- a RecordSource's records ------------------------------------------------------------


def records(bad_at=None, label=9):
    items = [(x, int(y)) for x, y in zip(X, Y)]
    if bad_at is not None:
        items[bad_at] = (X[bad_at], label)
    return items


def test_record_0_that_does_not_fit_the_model_is_named_before_the_first_step():
    """The old error was Keras's alone, without the record or the source."""
    model = build()
    wide = [(np.zeros(D + 1, np.float32), 1)] * N
    with pytest.raises(ValueError, match=r"(?s)Record 0 of RecordSource\(list, num_records=40\) does "
                       r"not fit the model.*expected axis -1 of input shape to have value 4"):
        fit(model, RecordSource(wide))
    assert model.privacy.steps == 0


def test_record_0_with_a_label_out_of_range_is_refused_before_the_first_step():
    model = build()
    with pytest.raises(ValueError, match=r"Record 0 has a label outside \[0, 2\].*3 outputs") \
            as caught:
        fit(model, RecordSource(records(bad_at=0, label=4711)))
    assert "4711" not in str(caught.value)  # the position, never the record's value
    assert model.privacy.steps == 0


def test_a_later_record_with_a_label_out_of_range_is_named_when_it_is_read():
    """The old error came from the loss, without a record index."""
    model = build()
    with pytest.raises(tf.errors.OpError, match=r"Record 23 has a label outside \[0, 2\]"):
        model.fit(RecordSource(records(bad_at=23, label=-1)), batch_size=20, epochs=5, verbose=0)


def test_a_record_weight_of_shape_1_is_refused_by_name():
    items = [(x, int(y), np.ones(1, np.float32)) for x, y in zip(X, Y)]
    model = build()
    with pytest.raises(ValueError, match=r"sample_weight of record 0.*shape \(1,\)"):
        fit(model, RecordSource(items))
    assert model.privacy.steps == 0


# -- sample_weight of shape [N, 1] ---------------------------------------------------------


def test_sample_weight_of_shape_n_by_1_trains_as_one_weight_per_example():
    """The old code passed the shape check, then failed while tracing the
    step (taken for per-token weights)."""
    weights = np.linspace(0.5, 2.0, N).astype(np.float32)
    flat, column = build(), build()
    fit(flat, sample_weight=weights, steps_per_epoch=3)
    fit(column, sample_weight=weights[:, None], steps_per_epoch=3)
    for a, b in zip(flat.get_weights(), column.get_weights()):
        np.testing.assert_array_equal(a, b)
    unweighted = build()
    fit(unweighted, steps_per_epoch=3)
    assert not np.array_equal(unweighted.trainable_weights[0].numpy(), flat.trainable_weights[0].numpy())


# -- ids beyond an Embedding's vocabulary ---------------------------------------------------


def _text_model(functional):
    keras.utils.set_random_seed(0)
    ids = keras.Input((3,), dtype="int32")
    if functional:
        features = keras.layers.Embedding(10, 4, name="tokens")(ids)
        logits = keras.layers.Dense(CLASSES)(keras.layers.GlobalAveragePooling1D()(features))
        model = tfdp.DPModel(ids, logits)
    else:
        model = tfdp.DPSequential([ids, keras.layers.Embedding(10, 4, name="tokens"),
                                   keras.layers.GlobalAveragePooling1D(),
                                   keras.layers.Dense(CLASSES)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("functional", [False, True])
@pytest.mark.parametrize("bad, shown", [(10, "10"), (-1, "-1"), (np.nan, "-2147483648")])
def test_an_id_beyond_the_vocabulary_is_refused_before_the_first_step(functional, bad, shown,
                                                                      monkeypatch):
    """One crafted record with id 10 in a vocabulary of 10 crashed the step
    that sampled it (a gather out of range on CPU): whether and when
    training failed depended on that record. It is refused by name now,
    whatever its sample weight (NaN reaches the int32 Input as its lowest value)."""
    monkeypatch.setenv("TFDP_SHOW_STEP_ERRORS", "1")  # the id as cast (by default withheld)
    ids = (np.arange(N * 3) % 10).reshape(N, 3).astype(np.float32 if bad is np.nan else np.int32)
    ids[17, 1] = bad
    model = _text_model(functional)
    steps = model.privacy.steps
    match = rf"ids in `x` that feed Embedding 'tokens' to lie in \[0, 9\].*record 17, which gives it id {shown}$"
    with pytest.raises(ValueError, match=match):
        fit(model, ids, Y, sample_weight=np.ones(N))
    assert model.privacy.steps == steps  # nothing ran
    with pytest.raises(ValueError, match="validation_data's x"):
        fit(model, ids[:16], Y[:16], validation_data=(ids, Y))
    fit(model, ids[:16], Y[:16])  # control: the same model trains on in-range ids


def _two_input_model():
    """Ids (float32) feed an Embedding directly, beside an amount that is no id."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((2,), name="tokens")
    amount = keras.Input((1,), name="amount")
    embedded = keras.layers.Embedding(10, 4, name="tokens_table")(tokens)
    features = keras.layers.Concatenate()([keras.layers.Flatten()(embedded), amount])
    model = tfdp.DPModel([tokens, amount], keras.layers.Dense(CLASSES)(features))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("as_dict", [False, True])
def test_ids_are_checked_as_the_embedding_receives_them(as_dict, monkeypatch):
    """After the float32 cast of the Input (9.99999999 becomes 10.0), with a
    dict mapped by input name (review findings: the first check compared
    float64 values and matched a dict by sorted keys)."""
    monkeypatch.setenv("TFDP_SHOW_STEP_ERRORS", "1")  # the id as cast (by default withheld)
    tokens = np.stack([np.arange(N) % 10, np.full(N, 9.5)], axis=1)  # toward zero: valid
    amount = np.full((N, 1), -1.5)  # not an id: never checked as one
    model = _two_input_model()

    def x(ids):
        return {"amount": amount, "tokens": ids} if as_dict else (ids, amount)

    fit(model, x(tokens), Y)  # control: valid ids, a negative amount
    crafted = tokens.copy()
    crafted[23, 1] = 9.99999999
    with pytest.raises(ValueError, match=r"'tokens_table'.*record 23, which gives it id 10\.0$"):
        fit(model, x(crafted), Y)


def test_inputs_keyed_other_than_their_names_are_refused():
    """The id check paired such inputs by name while Keras fed them by key,
    so one split-off record passed the check and crashed evaluation after
    the epoch's steps were charged (review finding). Keras asks for
    matching names; tfdp refuses others before the first step."""
    first, second = keras.Input((1,), name="b"), keras.Input((1,), name="a")
    with pytest.warns(UserWarning):
        model = tfdp.DPModel({"a": first, "b": second},
                             keras.layers.Dense(CLASSES)(keras.layers.Concatenate()([first, second])))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    steps = model.privacy.steps
    with pytest.raises(ValueError, match=r"Name each Input as its key.*\{'a': 'b', 'b': 'a'\}"):
        fit(model, {"a": X[:, :1], "b": X[:, 1:2]}, Y)
    assert model.privacy.steps == steps


class _KeepsTheLargestIdAtInference(keras.layers.Layer):
    def build(self, shape):
        self.largest = self.add_weight(shape=(), initializer="zeros", trainable=False)

    def call(self, ids, training=None):
        if not training:
            self.largest.assign(keras.ops.maximum(self.largest, keras.ops.max(
                keras.ops.cast(ids, "float32"))))
        return ids


def test_the_check_runs_no_layer_of_the_model_on_the_training_records():
    """A check that ran the model's layers over every record at inference
    (the second version did, to reach Embeddings behind them) let a layer
    that writes in inference keep the records' data, noise-free."""
    keras.utils.set_random_seed(0)
    keeper = _KeepsTheLargestIdAtInference()
    model = tfdp.DPSequential([keras.Input((3,), dtype="int32"), keeper,
                               keras.layers.Embedding(10, 4), keras.layers.Flatten(),
                               keras.layers.Dense(CLASSES)])
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.0, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ids = (np.arange(N * 3) % 5).reshape(N, 3).astype(np.int32)
    ids[11, 0] = 9  # the secret
    fit(model, ids, Y)
    assert float(keeper.largest.numpy()) < 9


def test_a_nested_inputs_dict_is_not_mistaken_for_renamed_inputs():
    """The name check looked for a name on every value of the inputs dict
    and crashed on a dict of dicts (review finding): only Inputs are compared."""
    tokens, amount = keras.Input((1,), name="tokens"), keras.Input((1,), name="amount")
    model = tfdp.DPModel({"features": {"tokens": tokens, "amount": amount}},
                         keras.layers.Dense(CLASSES)(keras.layers.Concatenate()([tokens, amount])))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fit(model, {"features": {"tokens": X[:, :1], "amount": X[:, 1:2]}}, Y)


@pytest.mark.parametrize("nesting", ["dict of dicts", "dict of lists", "mixed"])
def test_ids_in_nested_inputs_are_checked(nesting):
    """The check read only a flat dict and checked nothing in a nested one
    (review finding): x is paired with the model's inputs structure."""
    keras.utils.set_random_seed(0)
    tokens, amount = keras.Input((2,), dtype="int32", name="tokens"), keras.Input((1,), name="amount")
    structs = {"dict of dicts": ({"f": {"tokens": tokens, "amount": amount}},
                                 lambda t, a: {"f": {"tokens": t, "amount": a}}),
               "dict of lists": ({"f": [tokens, amount]}, lambda t, a: {"f": [t, a]}),
               "mixed": ({"tokens": tokens, "more": {"amount": amount}},
                         lambda t, a: {"tokens": t, "more": {"amount": a}})}
    struct, x = structs[nesting]
    features = keras.layers.Concatenate()(
        [keras.layers.Flatten()(keras.layers.Embedding(10, 2, name="tokens_table")(tokens)), amount])
    model = tfdp.DPModel(struct, keras.layers.Dense(CLASSES)(features))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ids = (np.arange(N * 2) % 10).reshape(N, 2).astype(np.int32)
    amounts = np.full((N, 1), 50.0, np.float32)  # not ids: never checked as ids
    fit(model, x(ids, amounts), Y, validation_data=(x(ids[:8], amounts[:8]), Y[:8]))  # control
    ids[13, 1] = 50
    with pytest.raises(ValueError, match=r"'tokens_table'.*record 13, which gives it an id outside"):
        fit(model, x(ids, amounts), Y)


@pytest.mark.parametrize("where", ["x", "validation_data"])
def test_a_dict_with_another_key_is_refused_when_an_input_feeds_an_embedding(where):
    """Keras feeds a dict model flatten(x) by position, so an extra key "n"
    (sorted before "tokens") reaches the Embedding; the check read
    x["tokens"] (review finding)."""
    keras.utils.set_random_seed(0)
    tokens, amount = keras.Input((2,), dtype="int32", name="tokens"), keras.Input((1,), name="amount")
    features = keras.layers.Concatenate()(
        [keras.layers.Flatten()(keras.layers.Embedding(10, 2)(tokens)), amount])
    model = tfdp.DPModel({"tokens": tokens, "amount": amount}, keras.layers.Dense(CLASSES)(features))
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ids = (np.arange(N * 2) % 10).reshape(N, 2).astype(np.int32)
    amounts = np.zeros((N, 1), np.float32)
    bad = ids.copy()
    bad[13, 0] = 50
    odd = {"amount": amounts, "n": bad, "tokens": ids}
    steps = model.privacy.steps
    with pytest.raises(ValueError, match=r"structured as the model's inputs.*'tokens'"):
        if where == "x":
            fit(model, odd, Y)
        else:
            fit(model, {"amount": amounts, "tokens": ids}, Y, validation_data=(odd, Y))
    assert model.privacy.steps == steps


def test_an_id_in_the_split_off_validation_records_is_named_as_a_record_of_x(monkeypatch):
    monkeypatch.setenv("TFDP_SHOW_STEP_ERRORS", "1")  # the id (by default withheld)
    ids = (np.arange(N * 3) % 10).reshape(N, 3).astype(np.int32)
    ids[37, 2] = 12
    with pytest.raises(ValueError, match=r"ids in `x`.*record 37, which gives it id 12$"):
        fit(_text_model(False), ids, Y, validation_split=0.25)
