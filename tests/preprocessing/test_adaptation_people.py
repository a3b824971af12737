"""A per-person adaptation is bound to fit's grouping of records into people.

Crafted person: person 999 has 40 records, all holding the unique id 99950.
Adapted with each record its own "person" (user_ids=np.arange(N)), 99950 is
a frequent token and enters the vocabulary: a fit whose user_ids group the
records otherwise is refused (naming the layer and the fix, never the id).
The same grouping under other id values is accepted, and a per-person
adaptation is accepted for a per-record fit, the statement saying so.
"""

import keras
import numpy as np
import pytest

import tfdp
from tfdp import preprocessing
from tfdp.data.users import UserRecords
from tfdp.preprocessing import provenance

UNIQUE = 99950
DELTA = 1e-5
PEOPLE = np.concatenate([np.repeat(np.arange(300), 2), np.full(40, 999)])
IDS = np.random.default_rng(0).integers(1, 6, size=PEOPLE.size)
IDS[PEOPLE == 999] = UNIQUE


def model_of(lookup):
    inputs = keras.Input((1,), dtype="int64")
    embedded = keras.layers.Embedding(12, 2)(lookup(inputs))
    model = tfdp.DPModel(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(embedded)))
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def adapted(user_ids):
    lookup = keras.layers.IntegerLookup(name="lookup", max_tokens=12)
    preprocessing.adapt_privately(lookup, IDS, epsilon=1.0, delta=1e-7, seed=0, user_ids=user_ids)
    return lookup


def fit(model, user_ids):
    kwargs = {} if user_ids is None else dict(user_ids=user_ids, examples_per_user=2)
    return model.fit(IDS[:, None], (IDS % 2).astype("int32"), batch_size=3, epochs=1,
                     steps_per_epoch=2, verbose=0, **kwargs)


def test_the_partition_digest_ignores_id_values_and_order_but_not_the_grouping():
    digest = provenance.partition_digest
    assert digest(UserRecords(PEOPLE)) == digest(UserRecords([f"p{p}" for p in PEOPLE * 7]))
    assert digest(UserRecords(PEOPLE)) != digest(UserRecords(np.arange(PEOPLE.size)))
    swapped = PEOPLE.copy()
    swapped[[0, -1]] = swapped[[-1, 0]]  # one record moves to another person
    assert digest(UserRecords(PEOPLE)) != digest(UserRecords(swapped))


def test_a_per_person_adaptation_with_other_people_is_refused():
    lookup = adapted(np.arange(PEOPLE.size))  # each record its own "person"
    assert UNIQUE in lookup.get_vocabulary()  # what the refusal keeps out of the model
    model = model_of(lookup)
    with pytest.raises(ValueError) as caught:
        fit(model, PEOPLE)
    message = str(caught.value)
    assert "'lookup'" in message and "group the records into people differently" in message
    assert "the same user_ids" in message and str(UNIQUE) not in message
    assert model.privacy.steps == 0


def test_the_same_people_under_other_ids_are_accepted():
    model = model_of(adapted([f"person-{p}" for p in PEOPLE]))
    assert UNIQUE not in model.get_layer("lookup").get_vocabulary()
    fit(model, PEOPLE)
    assert model.privacy.steps == 2


def test_a_per_person_adaptation_is_accepted_for_a_per_record_fit():
    model = model_of(adapted(PEOPLE))
    fit(model, None)
    statement = model.privacy.statement(DELTA)
    assert "adapted privately per person (which protects each record too)" in statement


def test_a_per_person_fit_through_a_one_hot_lookup_trains():
    """The lookup's one-hot output is int64; the old per-example rule fed it
    uncast to its einsum with float32 gradients (a TypeError at the first step)."""
    lookup = keras.layers.IntegerLookup(name="lookup", output_mode="one_hot", max_tokens=12,
                                        pad_to_max_tokens=True)
    preprocessing.adapt_privately(lookup, IDS, epsilon=1.0, delta=1e-7, seed=0, user_ids=PEOPLE)
    inputs = keras.Input((1,), dtype="int64")
    model = tfdp.DPModel(inputs, keras.layers.Dense(2)(lookup(inputs)))
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    fit(model, PEOPLE)
    assert model.privacy.steps == 2
    assert all(np.isfinite(w).all() for w in model.get_weights())
