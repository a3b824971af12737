"""tfdp.tuning.PrivateRandomSearch: tiny models, a few steps each."""

import math
import threading

import dp_accounting
import keras
import numpy as np
import pytest
from dp_accounting.dp_event import RepeatAndSelectDpEvent

pytest.importorskip("keras_tuner")

import tfdp  # noqa: E402
from tfdp.tuning import PrivateRandomSearch  # noqa: E402

N, BATCH, SPLIT = 100, 20, 0.2


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 3)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def _build(noise=None, layer=None):
    def build(hp):
        sigma = 1.5 if noise is None else noise(hp)
        model = tfdp.DPSequential([keras.Input((3,)), layer or keras.layers.Dense(2)])
        model.compile(
            optimizer=tfdp.optimizers.DPSGD(
                hp.Float("learning_rate", 0.05, 0.5, sampling="log"),
                l2_norm_clip=hp.Choice("clip", [0.5, 1.0]), noise_multiplier=sigma),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
    return build


def _refused_before_the_draw(build, match, x, y=None, **validation):
    """A search of `build` on (x, y) is refused with `match`, and its tuner
    is not spent: the refusal came before the number of trials was drawn."""
    tuner = PrivateRandomSearch(build, mean_trials=3)
    with pytest.raises(ValueError, match=match):
        tuner.search(x, y, batch_size=BATCH, epochs=1, **validation)
    with pytest.raises(ValueError, match="call search"):
        tuner.get_best_models()


def test_the_chosen_model_carries_the_search_and_keeps_it_through_save_and_load(trials, tmp_path):
    trials(3)
    tuner = PrivateRandomSearch(_build(), mean_trials=4, distribution="poisson")
    tuner.search(*_data(), batch_size=BATCH, epochs=2, validation_split=SPLIT)
    model = tuner.get_best_models()[0]
    hp = tuner.get_best_hyperparameters()[0]
    assert set(hp.values) == {"learning_rate", "clip"}
    assert isinstance(tuner.best_score, float)

    steps = 2 * math.ceil(N / BATCH)  # all N rows sampled, the held-out ones weigh 0
    by_hand = RepeatAndSelectDpEvent(dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(BATCH / N, dp_accounting.GaussianDpEvent(1.5)),
            steps),
        dp_accounting.GaussianDpEvent(10.0)]), 4.0, math.inf)
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(by_hand)
    assert model.privacy.steps == steps
    assert model.privacy.epsilon(1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    one_trial = dp_accounting.rdp.RdpAccountant()
    one_trial.compose(by_hand.event)
    assert model.privacy.epsilon(1e-5) > 1.3 * one_trial.get_epsilon(1e-5)
    assert "Search: this model was chosen" in model.privacy.statement(1e-5)

    path = str(tmp_path / "chosen.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.privacy.composed_event() == model.privacy.composed_event()
    assert loaded.privacy.epsilon(1e-5) == model.privacy.epsilon(1e-5)

    # Only the best is released: no other trial, score or count on the tuner.
    with pytest.raises(ValueError, match="Received: num_models=3"):
        tuner.get_best_models(num_models=3)
    public = {k: v for k, v in vars(tuner).items()}
    assert set(public) == {"_build", "mean_trials", "distribution", "shape", "_score",
                           "score_noise_multiplier", "_searches", "_best",
                           "_released_nothing"}
    assert len(tuner._best) == 3 and len(tuner._searches) == 1

    # A rerun pays again: the second choice carries the first search too.
    trials(1)
    tuner.search(*_data(), batch_size=BATCH, epochs=2, validation_split=SPLIT)
    second = tuner.get_best_models()[0]
    assert second.privacy.composed_event().events[1] == by_hand
    assert second.privacy.epsilon(1e-5) > model.privacy.epsilon(1e-5)


def test_public_validation_data_is_scored_exactly_and_not_charged(trials):
    trials(1)
    x, y = _data()
    tuner = PrivateRandomSearch(_build(), mean_trials=2)
    tuner.search(x, y, batch_size=BATCH, epochs=1, validation_data=(x[:10], y[:10]),
                 validation_data_is_public=True)
    inner = tuner.get_best_models()[0].privacy.composed_event().events[0].event.event
    assert [type(e).__name__ for e in inner.events] == ["SelfComposedDpEvent"]
    assert tuner.best_score * 10 == round(tuner.best_score * 10)  # an exact count of 10


@pytest.mark.parametrize("public", [False, True])
def test_a_search_calibrated_for_a_target_is_charged_the_target(trials, public):
    trials(2)
    x, y = _data()
    score_noise = None if public else 10.0
    sigma = tfdp.tuning.calibrate_search_noise(N, BATCH, 2, 6.0, 1e-3, mean_trials=3,
                                               score_noise_multiplier=score_noise)
    tuner = PrivateRandomSearch(_build(noise=lambda hp: sigma), mean_trials=3)
    validation = (dict(validation_data=(x[:10], y[:10]), validation_data_is_public=True)
                  if public else dict(validation_split=SPLIT))
    tuner.search(x, y, batch_size=BATCH, epochs=2, **validation)
    epsilon = tuner.get_best_models()[0].privacy.epsilon(1e-3)
    assert 6.0 * 0.999 < epsilon <= 6.0


def test_a_model_that_runs_several_steps_per_call_is_refused(trials):
    """Keras runs whole calls of `steps_per_execution` steps, so an epoch of 5
    steps at 3 per call runs 6: a search calibrated for 10 steps would be
    charged 12, over its target. Refused before any trial trains."""
    trials(2)

    def build(hp):
        model = _build()(hp)
        model.compile(optimizer=model.optimizer, loss=model.loss, steps_per_execution=3)
        return model

    _refused_before_the_draw(build, "steps_per_execution=3", *_data(), validation_split=SPLIT)


def test_a_search_after_one_that_drew_no_trial_is_refused(trials):
    """Retrying a Poisson search until it draws a trial runs a search of K
    conditioned on K >= 1, a larger mean than the ledger would charge."""
    tuner = PrivateRandomSearch(_build(), mean_trials=1, distribution="poisson")
    trials(0)
    tuner.search(*_data(), batch_size=BATCH, epochs=1, validation_split=SPLIT)
    with pytest.raises(ValueError, match="it drew no trial"):
        tuner.get_best_models()
    trials(2)
    with pytest.raises(ValueError, match="refuses another search"):
        tuner.search(*_data(), batch_size=BATCH, epochs=1, validation_split=SPLIT)


def test_an_id_beyond_the_vocabulary_is_refused_before_the_trials_are_drawn(trials):
    """A trial crashing on one record's id would reveal the record (and spend
    the tuner); the ids are checked on the default trial's model first."""
    trials(2)

    def build(hp):
        model = tfdp.DPSequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(8, 2),
                                   keras.layers.Flatten(), keras.layers.Dense(2)])
        model.compile(optimizer=tfdp.optimizers.DPSGD(hp.Float("learning_rate", 0.05, 0.5),
                                                      l2_norm_clip=1.0, noise_multiplier=1.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    ids = np.arange(N * 3).reshape(N, 3) % 8
    ids[5, 0] = 8
    _refused_before_the_draw(build, "record 5, which gives it an id outside", ids, ids[:, 0] % 2,
                             validation_split=SPLIT)


@pytest.mark.parametrize("where", ["y", "validation_data"])
def test_a_label_out_of_range_is_refused_before_the_trials_are_drawn(trials, where):
    """It was refused by the first trial's fit, after the draw: whether the
    search failed (and spent its tuner) depended on that record."""
    trials(2)
    x, y = _data()
    bad = y.copy()
    bad[7] = 5
    arguments = (dict(y=bad, validation_split=SPLIT) if where == "y" else
                 dict(y=y, validation_data=(x[:10], bad[:10])))
    _refused_before_the_draw(_build(), r"class indices in \[0, 1\].*1 label\(s\) outside that "
                             r"range", x, **arguments)


def test_fewer_output_units_in_a_drawn_trial_are_refused(trials):
    """Labels were checked against the default trial's 3 units; a drawn
    trial with 2 failed on a record labelled 2, after the draw (review)."""
    trials(4)

    def build(hp):
        rate = hp.Float("learning_rate", 0.05, 0.5, default=0.5)
        model = tfdp.DPSequential([keras.Input((3,)), keras.layers.Dense(3 if rate == 0.5 else 2)])
        model.compile(optimizer=tfdp.optimizers.DPSGD(rate, l2_norm_clip=1.0, noise_multiplier=1.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = _data()
    y[7] = 2
    with pytest.raises(ValueError, match=r"output shapes.*\[\(2,\)\]\) drawn"):
        PrivateRandomSearch(build, mean_trials=3).search(x, y, batch_size=BATCH, epochs=1,
                                                         validation_split=SPLIT)


def test_a_model_without_known_outputs_is_refused_before_the_draw(trials):
    """Its labels could not be checked before the draw (review)."""
    trials(1)

    def build(hp):
        model = tfdp.DPSequential([keras.layers.Dense(2)])
        model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    _refused_before_the_draw(build, "start it with keras.Input", *_data(), validation_split=SPLIT)


def test_a_vocabulary_that_varies_between_trials_is_refused(trials):
    """The ids were checked against the default trial's vocabulary: a drawn
    trial with a smaller one would crash on a record's id after the draw."""
    trials(4)

    def build(hp):
        rate = hp.Float("learning_rate", 0.05, 0.5, default=0.5)
        vocabulary = 32 if rate == 0.5 else 10  # every drawn trial: 10
        model = tfdp.DPSequential([keras.Input((3,), dtype="int32"),
                                   keras.layers.Embedding(vocabulary, 2),
                                   keras.layers.Flatten(), keras.layers.Dense(2)])
        model.compile(optimizer=tfdp.optimizers.DPSGD(rate, l2_norm_clip=1.0, noise_multiplier=1.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    ids = np.arange(N * 3).reshape(N, 3) % 10
    tuner = PrivateRandomSearch(build, mean_trials=3)
    with pytest.raises(ValueError, match=r"Embedding vocabularies.*\(\[\('int32', \[10\]\)\], \[\(2,\)\]\) drawn"):
        tuner.search(ids, ids[:, 0] % 2, batch_size=BATCH, epochs=1, validation_split=SPLIT)


def test_an_input_dtype_that_varies_between_trials_is_refused(trials):
    """bfloat16 rounds id 999 to 1000: ids checked as the default trial's
    int32 Input sees them would crash a drawn trial (review finding)."""
    trials(4)

    def build(hp):
        rate = hp.Float("learning_rate", 0.05, 0.5, default=0.5)
        model = tfdp.DPSequential([
            keras.Input((3,), dtype="int32" if rate == 0.5 else "bfloat16"),
            keras.layers.Embedding(1000, 2), keras.layers.Flatten(), keras.layers.Dense(2)])
        model.compile(optimizer=tfdp.optimizers.DPSGD(rate, l2_norm_clip=1.0, noise_multiplier=1.5),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    ids = np.arange(N * 3).reshape(N, 3) % 1000
    ids[5, 0] = 999
    tuner = PrivateRandomSearch(build, mean_trials=3)
    with pytest.raises(ValueError, match=r"Input dtypes.*\[\('bfloat16', \[1000\]\)\], \[\(2,\)\]\) drawn"):
        tuner.search(ids, ids[:, 0] % 2, batch_size=BATCH, epochs=1, validation_split=SPLIT)


def test_trials_whose_noise_could_differ_are_refused_before_any_training(trials, monkeypatch):
    trials(2)
    fits = []
    fit = tfdp.DPSequential.fit

    def counted_fit(self, *args, **kwargs):
        fits.append(1)
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(tfdp.DPSequential, "fit", counted_fit)
    tuner = PrivateRandomSearch(_build(noise=lambda hp: hp.Float("sigma", 1.0, 2.0)), 3)
    with pytest.raises(ValueError, match=r"change it: sigma \(drawn sigma="):
        tuner.search(*_data(), batch_size=BATCH, validation_split=SPLIT)
    assert not fits
    # Negative control: a fixed sigma declared as a hyperparameter is accepted.
    fixed = PrivateRandomSearch(_build(noise=lambda hp: hp.Fixed("sigma", 1.5)), 3)
    fixed.search(*_data(), batch_size=BATCH, validation_split=SPLIT)
    assert len(fits) == 2


def test_a_trial_sharing_weights_with_an_earlier_one_is_refused(trials):
    trials(2)
    tuner = PrivateRandomSearch(_build(layer=keras.layers.Dense(2)), 2)
    with pytest.raises(ValueError, match="shares .*with an earlier one"):
        tuner.search(*_data(), batch_size=BATCH, validation_split=SPLIT)


@pytest.mark.parametrize("kwargs, match", [
    (dict(validation_split=0.2, callbacks=[]), r"Received: \['callbacks'\]"),
    (dict(), "exactly one of validation_split"),
    (dict(validation_split=0.2, validation_data_is_public=True), "is private"),
])
def test_searches_that_would_leak_are_refused(kwargs, match):
    tuner = PrivateRandomSearch(_build(), 2)
    with pytest.raises(ValueError, match=match):
        tuner.search(*_data(), batch_size=BATCH, **kwargs)


def test_a_fixed_number_of_trials_is_refused():
    with pytest.raises(ValueError, match="Received: max_trials=5"):
        PrivateRandomSearch(_build(), mean_trials=5, max_trials=5)


def test_a_hypermodel_that_cannot_reach_the_child_process_is_named(in_child):
    lock = threading.Lock()  # no pickle carries a lock

    def build(hp):
        with lock:
            return _build()(hp)

    tuner = PrivateRandomSearch(build, 2)
    with pytest.raises(TypeError, match=r"its `hypermodel` must be picklable.*Received: "
                                        r"hypermodel=<function .*build"):
        tuner.search(*_data(), batch_size=BATCH, validation_split=SPLIT)


@pytest.mark.parametrize("cut", [(0, 0), (5, 4)])
def test_validation_data_without_records_is_refused_before_the_draw(trials, cut):
    """Issue 55, item 4: it was a withheld ZeroDivisionError after the draw."""
    x, y = _data()
    _refused_before_the_draw(_build(), r"validation_data \(x_val, y_val\) with the same, non-zero",
                             x, y, validation_data=(x[:cut[0]], y[:cut[1]]))
