"""A SavedModel of DP-trained variables keeps their ledger (eighth review, G8).

Model A (a nested `keras.Model` encoder and a head) trains 5 steps by
DP-SGD; the encoder is exported by plain Keras (`encoder.export`, a
SavedModel), or A by `DPModel.export`, and read back as
`keras.layers.TFSMLayer` in a DP model B that trains 5 steps on the same
data. B's statement must charge A's 5 steps: before, B stated its own 5
steps only (7.7183 where the 10 steps compose to 10.0324).
"""

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tests.carrier_models import encoder, model_on
from tfdp.models import saved_model_ledgers

DELTA = 1e-5
CRAFTED = 4711.0625  # a raw feature value of one record: never in the ledger


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 4)).astype("float32")
    x[0, 1] = CRAFTED
    return x, (x[:, 0] > 0).astype("int32")


def _fit(model, steps=5):
    x, y = _data()
    model.compile(optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=0.8),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=64, epochs=1, steps_per_epoch=steps, verbose=0)
    return model


def _independent(steps):
    """dp_accounting's RDP epsilon of `steps` steps of the fits above (q = 64/256)."""
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.PoissonSampledDpEvent(
        0.25, dp_accounting.GaussianDpEvent(0.8)), steps)
    return accountant.get_epsilon(DELTA)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A trained 5 steps; its encoder exported by plain Keras, A by DPModel.export."""
    keras.utils.set_random_seed(0)
    a = _fit(model_on(encoder(), "A"))
    root = tmp_path_factory.mktemp("exports")
    a.get_layer("enc").export(root / "enc", verbose=False)
    a.export(root / "a", verbose=False)
    return a, root


def _carries_a(b, a):
    assert [c.label for c in b.privacy.carried.values()] == ["model 'A'"]
    assert b.privacy.epsilon(DELTA) == pytest.approx(a.privacy.epsilon(DELTA), rel=1e-12)
    assert "model 'A'" in b.privacy.statement(DELTA)


def test_b_on_the_exported_encoder_states_the_ten_steps(trained):
    """The review's reproducer: B (5 steps, training the SavedModel's
    variables too) states dp_accounting's epsilon of A's and B's 10 steps."""
    a, root = trained
    b = _fit(model_on(keras.layers.TFSMLayer(root / "enc", call_endpoint="serve",
                                             trainable=True), "B"))
    assert b.privacy.epsilon(DELTA) == pytest.approx(_independent(10), rel=1e-9)
    assert b.privacy.epsilon(DELTA) > _independent(5) + 1.0  # 10.03 > 7.72: not B's alone
    assert "model 'A'" in b.privacy.statement(DELTA)


def test_a_frozen_tfsm_layer_of_the_dp_models_own_export(trained):
    a, root = trained
    _carries_a(model_on(keras.layers.TFSMLayer(root / "a", call_endpoint="serve"), "B"), a)


def test_the_export_holds_a_sealed_ledger_of_events_only(trained):
    _, root = trained
    for name in ("enc", "a"):
        with open(saved_model_ledgers.ledger_path(root / name), encoding="utf-8") as file:
            text = file.read()
        assert '"sha256"' in text and "4711" not in text


def test_a_shared_prefix_is_charged_once(trained):
    """B holds A's live encoder and a TFSMLayer of its export: A's
    training is one (same identity), charged once."""
    a, root = trained
    inputs = keras.Input((4,))
    layer = keras.layers.TFSMLayer(root / "enc", call_endpoint="serve")
    both = keras.layers.Concatenate()([a.get_layer("enc")(inputs), layer(inputs)])
    _carries_a(tfdp.DPModel(inputs, keras.layers.Dense(2)(both), name="B"), a)


def test_export_archive_and_tf_saved_model_save_and_load(trained, tmp_path):
    a, _ = trained
    archive = keras.export.ExportArchive()
    archive.track(a.get_layer("enc"))
    archive.add_endpoint("serve", a.get_layer("enc").call,
                         input_signature=[keras.InputSpec(shape=(None, 4), dtype="float32")])
    archive.write_out(tmp_path / "archive", verbose=False)
    _carries_a(model_on(keras.layers.TFSMLayer(tmp_path / "archive", call_endpoint="serve"),
                        "B"), a)
    tf.saved_model.save(a.get_layer("enc"), str(tmp_path / "saved"))
    loaded = tf.saved_model.load(str(tmp_path / "saved"))
    variables = [v for v in tf.train.TrackableView(loaded).descendants()
                 if isinstance(v, tf.Variable)]
    assert variables
    ledger = tfdp.models.weight_ledgers.carrier_ledger_of(variables)
    assert [c.label for c in ledger.carried.values()] == ["model 'A'"]


def test_a_module_of_the_raw_tf_variables_under_keras_variables(trained, tmp_path):
    """The ninth review's H3: a tf.Module holding `dense.kernel.value` (the
    tf.Variables inside Keras 3's variables) and a serving function, saved
    with tf.saved_model.save: B on it charged its own steps only."""
    a, _ = trained
    dense = a.get_layer("enc").get_layer("enc_dense")
    module = tf.Module()
    module.kernel, module.bias = dense.kernel.value, dense.bias.value
    module.serve = tf.function(lambda x: tf.tanh(tf.matmul(x, module.kernel) + module.bias),
                               input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    tf.saved_model.save(module, str(tmp_path / "module"))
    _carries_a(model_on(keras.layers.TFSMLayer(tmp_path / "module", call_endpoint="serve"),
                        "B"), a)


def test_the_public_alias_of_the_reader_is_hooked_too():
    """tf_keras's SavedModel loader calls tf.__internal__.saved_model.load_partial
    (review 9, "not done"): it must be the hooked reader, or the ledger is
    not read back there."""
    from tensorflow.python.saved_model import load as tf_load
    assert tf.__internal__.saved_model.load_partial is tf_load.load_partial
    assert tf_load.load_partial.__wrapped__ is not tf_load.load_partial


def test_an_untrained_export_carries_nothing(tmp_path):
    """Control: a fresh encoder's export has no ledger (and clears one an
    earlier export left in the directory); B on it states its own steps."""
    path = tmp_path / "fresh"
    (path / saved_model_ledgers.DIRECTORY).mkdir(parents=True)
    (path / saved_model_ledgers.DIRECTORY / saved_model_ledgers.FILENAME).write_text("stale")
    encoder("fresh").export(path, verbose=False)
    assert not (path / saved_model_ledgers.DIRECTORY / saved_model_ledgers.FILENAME).exists()
    b = _fit(model_on(keras.layers.TFSMLayer(path, call_endpoint="serve"), "B"))
    assert b.privacy.carried == {}
    assert b.privacy.epsilon(DELTA) == pytest.approx(_independent(5), rel=1e-9)


def test_a_damaged_ledger_is_refused(trained, tmp_path):
    a, _ = trained
    path = tmp_path / "enc"
    a.get_layer("enc").export(path, verbose=False)
    ledger = saved_model_ledgers.ledger_path(path)
    with open(ledger, encoding="utf-8") as file:
        text = file.read()
    assert '"count": 5' in text
    with open(ledger, "w", encoding="utf-8") as file:
        file.write(text.replace('"count": 5', '"count": 1'))
    with pytest.raises(ValueError, match="ledger of the SavedModel .* is refused.*checksum"):
        keras.layers.TFSMLayer(path, call_endpoint="serve")


def test_a_deleted_ledger_loads_as_never_trained(trained, tmp_path):
    """Documented, as a `.weights.h5` whose ledger dataset is removed: a
    SavedModel without its ledger file cannot be told from an untrained one."""
    a, _ = trained
    path = tmp_path / "a"
    a.export(path, verbose=False)
    tf.io.gfile.remove(saved_model_ledgers.ledger_path(path))
    assert model_on(keras.layers.TFSMLayer(path, call_endpoint="serve"), "B").privacy.carried == {}
