"""Sparse noise for embedding tables (DPOptimizer(sparse_embeddings=...)).

Checks the mechanism term by term: the selection's counts and their
sensitivity (a crafted record that alone touches a row is selected with the
analysed probability), noise on the selected rows only, no update of the
others, equivalence to dense noise when every row is selected, the
gradient's raised noise and the ledger's joint event against a direct
dp_accounting computation, and the refusals.
"""

import math
import statistics

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.accounting.joint_gaussian import as_one_gaussian
from tfdp.mechanisms.gaussian import normals
from tfdp.optimizers import SparseNoise, sparse_embeddings as sparse
from tfdp.per_example.rules.embedding import EmbeddingGrads

V, T, DIM = 300, 6, 4
_PHI = statistics.NormalDist()


def _data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, V, size=(n, T)).astype("int32")
    return x, (x[:, 0] % 2).astype("float32")


def _model(name="tok"):
    inputs = keras.Input((T,), dtype="int32")
    rows = keras.layers.Embedding(V, DIM, name=name)(inputs)
    pooled = keras.layers.GlobalAveragePooling1D()(rows)
    return tfdp.DPModel(inputs, keras.layers.Dense(1, name="head")(pooled))


def _optimizer(setting, noise_multiplier=1.0, inner=None, **kwargs):
    return tfdp.optimizers.DPOptimizer(
        inner or keras.optimizers.SGD(0.5), l2_norm_clip=1.0, noise_multiplier=noise_multiplier,
        seed=3, sparse_embeddings={"tok": setting}, **kwargs)


def _compile(model, optimizer):
    model.compile(optimizer=optimizer, loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


@pytest.fixture(scope="module")
def fitted():
    """A 3-step fit whose threshold no row can pass: the table must not move
    (weight decay after the noise included: it is masked like the noise)."""
    x, y = _data()
    model = _compile(_model(), _optimizer(SparseNoise(4.0, threshold=1e6), weight_decay=0.1,
                                          weight_decay_placement="after_noise"))
    model.build((None, T))
    table = model.get_layer("tok").embeddings.numpy().copy()
    head = model.get_layer("head").kernel.numpy().copy()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    return model, table, head


def test_rows_not_selected_get_exactly_no_update(fitted):
    model, table, head = fitted
    np.testing.assert_array_equal(model.get_layer("tok").embeddings.numpy(), table)
    assert np.any(model.get_layer("head").kernel.numpy() != head)  # the step did run


def test_the_ledger_charges_one_gaussian_of_the_step_noise_multiplier(fitted):
    model = fitted[0]
    steps, q, z = model.privacy.steps, 32 / 96, 1.0
    assert steps == 3
    sigma_g = (z ** -2 - 4.0 ** -2) ** -0.5
    direct = dp_accounting.rdp.RdpAccountant()
    direct.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    gradient_only = dp_accounting.rdp.RdpAccountant()
    gradient_only.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma_g)), steps)
    epsilon = model.privacy.epsilon(1e-5)
    assert epsilon == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    # The selection's term: without it the ledger would charge sigma_g alone.
    assert epsilon > gradient_only.get_epsilon(1e-5) * 1.01
    pld = dp_accounting.pld.PLDAccountant()
    pld.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    assert model.privacy.epsilon(1e-5, accountant="pld") == pytest.approx(
        pld.get_epsilon(1e-5), rel=1e-3)


def test_the_statement_names_the_split(fitted):
    text = fitted[0].privacy.statement(1e-5)
    assert "row selection counts (noise multiplier 4)" in text
    assert f"gradient (noise multiplier {(1 - 1 / 16) ** -0.5:.4g})" in text
    assert "one Gaussian of noise multiplier 1" in text


def test_the_joint_event_is_one_gaussian_and_survives_the_ledger_file():
    optimizer = _optimizer(SparseNoise(3.0, threshold=2.0), noise_multiplier=1.3)
    event = optimizer.step_event(0.01)
    assert as_one_gaussian(event).event.noise_multiplier == pytest.approx(1.3, rel=1e-12)
    ledger = tfdp.accounting.PrivacyLedger()
    ledger.record(event, 10)
    again = tfdp.accounting.PrivacyLedger.from_json(ledger.to_json())
    assert again.epsilon(1e-5) == ledger.epsilon(1e-5)
    whole = tfdp.accounting.PrivacyLedger()  # q = 1: the same one Gaussian, named
    whole.record(optimizer.step_event(1.0), 3)
    plain = tfdp.accounting.PrivacyLedger()
    plain.record(dp_accounting.GaussianDpEvent(1.3), 3)
    assert whole.epsilon(1e-5) == pytest.approx(plain.epsilon(1e-5), rel=1e-9)
    assert "row selection counts" in whole.statement(1e-5)


def _grads(ids, seed=0):
    g = tf.random.stateless_normal(list(ids.shape) + [DIM], [seed, 1])
    table = tf.Variable(tf.zeros([V, DIM]))
    return EmbeddingGrads(tf.constant(ids), g, table), table


def test_every_row_selected_is_dense_noise():
    """Threshold below every count: the table's noisy sum is the sum plus the
    same N(0, s^2) draw on every row as a dense draw of its shape."""
    row_sum = tf.random.stateless_normal([V, DIM], [1, 2])
    seed = tf.constant([5, 6], tf.int64)
    everything = tf.ones([V], tf.bool)
    noisy = sparse.noisy_rows(row_sum, everything, 2.5, seed)
    dense = row_sum + normals([tf.constant([V, DIM])], [seed], [tf.float32], stddev=2.5)[0]
    np.testing.assert_array_equal(noisy.numpy(), dense.numpy())
    selected = sparse.selected_rows(tf.zeros([V]), SparseNoise(4.0, threshold=-1e9), seed)
    assert bool(tf.reduce_all(selected))


def test_the_gradient_noise_pays_for_the_selection():
    """All rows selected, zero clipped sum: the noise on the table is
    sigma_g C = (z^-2 - sigma_c^-2)^(-1/2) C, not z C (the split's term)."""
    ids = np.arange(8 * T, dtype=np.int32).reshape(8, T)
    part, table = _grads(ids)
    per_example = tfdp.per_example.PerExampleGradients([table], [part])
    setting = SparseNoise(2.0, threshold=-1e9)
    out, selections = sparse.sparse_noisy_means(
        [tf.zeros([V, DIM])], [table], per_example, tf.ones([8]),
        {id(table): ("tok", setting)}, 1.0, lambda sigma: sigma * 1.0,
        lambda dense, s: dense, tf.constant([9, 9], tf.int64))
    measured = float(tf.math.reduce_std(out[0]))
    sigma_g = (1 - 1 / 4) ** -0.5  # 1.155
    assert measured == pytest.approx(sigma_g, rel=0.05)
    assert abs(measured - 1.0) > 0.08  # negative control: z C = 1 is told apart
    assert bool(tf.reduce_all(selections[0]))


def test_unselected_rows_of_the_noisy_sum_are_exactly_zero():
    row_sum = tf.random.stateless_normal([V, DIM], [3, 4])
    selected = tf.range(V) % 3 == 0
    noisy = sparse.noisy_rows(row_sum, selected, 1.0, tf.constant([1, 1], tf.int64)).numpy()
    assert np.all(noisy[~selected.numpy()] == 0.0)
    assert np.all(noisy[selected.numpy()] != row_sum.numpy()[selected.numpy()])


def test_under_xla_the_noise_is_drawn_for_every_row_and_masked():
    row_sum = tf.random.stateless_normal([V, DIM], [3, 4])
    selected = tf.range(V) % 3 == 0
    seed = tf.constant([1, 1], tf.int64)
    compiled = tf.function(lambda: sparse.noisy_rows(row_sum, selected, 1.0, seed, True),
                           jit_compile=True)().numpy()
    dense = (row_sum + normals([tf.shape(row_sum)], [seed], [tf.float32])[0]).numpy()
    np.testing.assert_allclose(compiled[selected.numpy()], dense[selected.numpy()], rtol=1e-5)
    assert np.all(compiled[~selected.numpy()] == 0.0)


def test_each_record_counts_at_most_sqrt_k():
    """A crafted record with repeats and many distinct rows: its count vector
    (the selection's sensitivity) has L2 norm <= sqrt(k); repeats count once."""
    crafted = np.array([[7, 7, 7, 8, 9, 10]], np.int32)
    part, _ = _grads(crafted)
    one = sparse.contribution_counts(part, tf.ones([1]), max_rows=2, vocabulary=V).numpy()
    assert np.linalg.norm(one) <= math.sqrt(2)  # exactly: w = sqrt(2/4) rounded down
    assert np.linalg.norm(one) == pytest.approx(math.sqrt(2), rel=1e-3)
    for n in range(3, 200):  # n w^2 <= k for every n > k, as the float64 values are
        crafted_n = EmbeddingGrads(tf.range(n)[None], tf.zeros([1, n, 1]),
                                   tf.Variable(tf.zeros([1, 1])))
        counts = sparse.contribution_counts(crafted_n, tf.ones([1]), 2, n).numpy()
        assert float(np.sum(counts.astype(np.float64) ** 2)) <= 2.0
    assert one[7] == one[8] > 0 and one[11] == 0
    plenty = sparse.contribution_counts(part, tf.ones([1]), max_rows=64, vocabulary=V).numpy()
    assert plenty[7] == 1.0 and plenty.sum() == 4.0  # weight 1, each distinct row once
    padded = sparse.contribution_counts(part, tf.zeros([1]), max_rows=64, vocabulary=V)
    assert float(tf.reduce_sum(padded)) == 0.0  # a padding row counts nothing


def test_a_row_one_record_alone_touched_is_selected_with_the_analysed_probability():
    """Crafted: each of 2000 records alone touches its own row (count 1).
    Selected with probability 1 - Phi((T - 1) / s), s = sigma_c sqrt(k);
    untouched rows (negative control) with 1 - Phi(T / s)."""
    n, vocabulary, k = 2000, 4000, 4
    ids = np.arange(n, dtype=np.int32)[:, None]  # record i touches row i only
    part = EmbeddingGrads(tf.constant(ids), tf.zeros([n, 1, 1]), tf.Variable(tf.zeros([1, 1])))
    counts = sparse.contribution_counts(part, tf.ones([n]), k, vocabulary)
    setting = SparseNoise(0.5, threshold=1.5, max_rows_per_example=k)
    s = setting.count_stddev()  # 1.0
    selected = sparse.selected_rows(counts, setting, tf.constant([11, 12], tf.int64)).numpy()
    touched, untouched = selected[:n].mean(), selected[n:].mean()
    p_touched, p_untouched = 1 - _PHI.cdf((1.5 - 1) / s), 1 - _PHI.cdf(1.5 / s)
    for observed, p in ((touched, p_touched), (untouched, p_untouched)):
        assert abs(observed - p) < 4 * math.sqrt(p * (1 - p) / n)
    assert touched - untouched > 0.15  # the rows differ, as the counts do


def test_a_fit_updates_only_looked_up_rows_with_a_high_threshold():
    """Rows no record looked up have count 0: at threshold 6 sigma above 0
    they are (with probability 1e-9 a row) never selected, never moved."""
    x, y = _data(seed=1)
    x[:, :] = x % 20  # the records use rows 0..19 only
    model = _compile(_model(), _optimizer(SparseNoise(4.0, threshold=6 * 32.0)))
    model.build((None, T))
    before = model.get_layer("tok").embeddings.numpy().copy()
    model.fit(x, y, batch_size=96, epochs=1, verbose=0)
    after = model.get_layer("tok").embeddings.numpy()
    np.testing.assert_array_equal(after[20:], before[20:])


def test_user_level_counts_people():
    x, y = _data(n=64, seed=2)
    model = _compile(_model(), _optimizer(SparseNoise(4.0, threshold=-1e9)))
    model.fit(x, y, user_ids=np.arange(64) // 4, examples_per_user=4, batch_size=8, epochs=1,
              verbose=0)
    assert model.privacy.relation == "add_or_remove_user"


def test_a_target_epsilon_calibrates_z_and_the_ledger_ends_within_it():
    x, y = _data(n=64, seed=3)
    model = _compile(_model(), tfdp.optimizers.DPOptimizer(
        keras.optimizers.SGD(0.1), l2_norm_clip=1.0, target_epsilon=2.0, target_delta=1e-5,
        seed=1, sparse_embeddings={"tok": SparseNoise(8.0, threshold=1.0)}))
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert model.privacy.steps == 8
    assert 1.9 < model.privacy.epsilon(1e-5) <= 2.0 * (1 + 1e-6)


def test_config_round_trip():
    optimizer = _optimizer(SparseNoise(3.0, threshold=2.0, max_rows_per_example=8))
    again = tfdp.optimizers.DPOptimizer.from_config(optimizer.get_config())
    assert again.sparse_embeddings["tok"].get_config() == {
        "selection_noise_multiplier": 3.0, "threshold": 2.0, "max_rows_per_example": 8}


class _OwnNoise(tfdp.optimizers.DPOptimizer):
    """A mechanism with its own noise step (as DPBandMF, AdaDP, DPIS)."""

    def noisy_gradients(self, sums, step_info, variables):
        return sums


@pytest.mark.parametrize("make, match", [
    (lambda: SparseNoise(0.0, 1.0), "selection_noise_multiplier"),
    (lambda: SparseNoise(2.0, float("nan")), "threshold"),
    (lambda: SparseNoise(2.0, 1.0, max_rows_per_example=0), "max_rows_per_example"),
    (lambda: _optimizer(SparseNoise(1.0, 1.0)), "sigma_c must leave noise"),
    (lambda: _optimizer(SparseNoise(4.0, 1.0), target_unclipped_quantile=0.5),
     "adaptive clipping"),
    (lambda: tfdp.optimizers.DPOptimizer(keras.optimizers.SGD(), 1.0, 1.0,
                                         sparse_embeddings={"tok": 3.0}), "SparseNoise"),
    (lambda: _OwnNoise(keras.optimizers.SGD(), 1.0, 1.0,
                       sparse_embeddings={"tok": SparseNoise(4.0, 1.0)}), "changes that step"),
])
def test_refused_settings(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


class _Reader(keras.layers.Layer):
    """Reads another layer's table (a tied embedding)."""

    def __init__(self, table, **kwargs):
        super().__init__(**kwargs)
        self.table = table

    def call(self, x):
        return tf.matmul(x, self.table, transpose_b=True)


def _tied_model():
    inputs = keras.Input((T,), dtype="int32")
    embedding = keras.layers.Embedding(V, DIM, name="tok")
    pooled = keras.layers.GlobalAveragePooling1D()(embedding(inputs))
    logits = _Reader(embedding.embeddings, name="reader")(pooled)
    return tfdp.DPModel(inputs, keras.layers.Dense(1)(logits))


class _OwnEmbedding(keras.layers.Embedding):
    """A subclass may read its table elsewhere (as ReversibleEmbedding does)."""


def _subclass_model():
    inputs = keras.Input((T,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(_OwnEmbedding(V, DIM, name="tok")(inputs))
    return tfdp.DPModel(inputs, keras.layers.Dense(1)(pooled))


@pytest.mark.parametrize("model, name, match", [
    (_model, "nope", "does not have"),
    (_subclass_model, "tok", "_OwnEmbedding"),
    (_model, "head", "keras.layers.Embedding only"),
    (_tied_model, "tok", "tied embeddings"),
])
def test_refused_layers_before_the_first_step(model, name, match):
    built = model()
    optimizer = tfdp.optimizers.DPOptimizer(keras.optimizers.SGD(), 1.0, 1.0, seed=1,
                                            sparse_embeddings={name: SparseNoise(4.0, 1.0)})
    _compile(built, optimizer)
    x, y = _data(n=16)
    with pytest.raises(ValueError, match=match):
        built.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert built.privacy.steps == 0


def test_physical_batches_refused():
    model = _compile(_model(), _optimizer(SparseNoise(4.0, 1.0)))
    x, y = _data(n=16)
    with pytest.raises(ValueError, match="logical batch"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, physical_batch_size=4)


def test_no_table_shares_a_noise_key_with_another():
    """Table n's streams fold n into their own key (a review found table 512's
    selection on table 0's row noise when n was added to the stream)."""
    from tfdp.mechanisms.gaussian import fold_seed
    from tfdp.optimizers import sparse_embeddings as sparse
    seed = tf.constant([7, 11], tf.int64)
    keys = [tuple(fold_seed(fold_seed(seed, stream), n).numpy())
            for stream in (sparse.SELECTION_STREAM, sparse.ROWS_STREAM) for n in range(1100)]
    assert len(set(keys)) == len(keys)
    shifted = {tuple(fold_seed(seed, sparse.SELECTION_STREAM + n).numpy()) for n in range(1100)}
    assert shifted & {tuple(fold_seed(seed, sparse.ROWS_STREAM + n).numpy()) for n in range(1100)}
