"""make_dataset: one element per step, gathered in TensorFlow, fresh every epoch."""

import numpy as np
import pytest
import tensorflow as tf

from tfdp.data import PoissonSampler, make_dataset, sampling

N = 300


def source():
    # Row i of x holds i everywhere, so a gathered row names its record.
    x = np.repeat(np.arange(N, dtype=np.float32)[:, None, None], 3, axis=1)
    x = np.repeat(x, 2, axis=2)  # (N, 3, 2)
    y = (np.arange(N) % 7).astype(np.int64)
    return x, y


def check_step(batch_x, batch_y, mask, sampler):
    batch_x, batch_y, mask = batch_x.numpy(), batch_y.numpy(), mask.numpy()
    assert mask.dtype == np.float32
    assert batch_x.shape[0] == batch_y.shape[0] == mask.shape[0]
    assert batch_x.shape[0] % sampler.padded_size == 0
    real = mask == 1
    rows = batch_x[real, 0, 0].astype(np.int64)
    np.testing.assert_array_equal(batch_x[real], source()[0][rows])
    np.testing.assert_array_equal(batch_y[real], rows % 7)
    # Padding gathers record 0 and is masked out.
    assert np.all(batch_x[~real] == 0)
    return rows


def test_element_spec_and_cardinality():
    sampler = PoissonSampler(N, 30, seed=0)
    dataset = make_dataset(sampler, source())
    (x_spec, y_spec), mask_spec = dataset.element_spec
    assert x_spec.shape.as_list() == [None, 3, 2] and x_spec.dtype == tf.float32
    assert y_spec.shape.as_list() == [None] and y_spec.dtype == tf.int64
    assert mask_spec.shape.as_list() == [None] and mask_spec.dtype == tf.float32
    assert int(dataset.cardinality()) == sampler.steps_per_epoch == 10


def test_steps_rows_and_fresh_draws_per_iteration():
    sampler = PoissonSampler(N, 30, seed=0)
    dataset = make_dataset(sampler, source())
    epochs = []
    for _ in range(3):
        steps = []
        for (batch_x, batch_y), mask in dataset:
            assert batch_x.shape[0] == sampler.padded_size
            steps.append(tuple(check_step(batch_x, batch_y, mask, sampler)))
        assert len(steps) == sampler.steps_per_epoch
        assert len(set(steps)) == len(steps)  # fresh draw per step
        epochs.append(steps)
    assert epochs[0] != epochs[1] != epochs[2]  # fresh draws per iteration


def test_dict_structure_and_tensor_inputs():
    x, y = source()
    sampler = PoissonSampler(N, 30, seed=1)
    dataset = make_dataset(
        sampler, {"features": {"image": tf.constant(x)}, "label": y}
    )
    batch, mask_spec = dataset.element_spec
    assert set(batch) == {"features", "label"}
    assert batch["features"]["image"].shape.as_list() == [None, 3, 2]
    for batch, mask in dataset.take(3):
        check_step(batch["features"]["image"], batch["label"], mask, sampler)


def test_single_array():
    x, _ = source()
    sampler = PoissonSampler(N, 30, seed=1)
    dataset = make_dataset(sampler, x)
    assert dataset.element_spec[0].shape.as_list() == [None, 3, 2]
    batch, mask = next(iter(dataset))
    batch, real = batch.numpy(), mask.numpy() == 1
    rows = batch[real, 0, 0].astype(np.int64)
    assert np.all(np.diff(rows) > 0)  # a draw: sorted, distinct
    np.testing.assert_array_equal(batch[real], x[rows])  # whole records gathered
    assert np.all(batch[~real] == 0)  # padding is record 0, masked out


def test_oversized_draw_passes_through(monkeypatch):
    sampler = PoissonSampler(N, 30, seed=0)
    forced = np.arange(sampler.padded_size + 5, dtype=np.int64)
    monkeypatch.setattr(sampler, "sample_indices", lambda key, step: tf.constant(forced))
    dataset = make_dataset(sampler, source())
    count = 0
    for (batch_x, batch_y), mask in dataset:
        assert batch_x.shape[0] == 2 * sampler.padded_size
        rows = check_step(batch_x, batch_y, mask, sampler)
        np.testing.assert_array_equal(rows, forced)
        count += 1
    assert count == sampler.steps_per_epoch


def test_same_seed_same_dataset():
    a = make_dataset(PoissonSampler(N, 30, seed=5), source())
    b = make_dataset(PoissonSampler(N, 30, seed=5), source())
    for (_, mask_a), (_, mask_b) in zip(a, b):
        np.testing.assert_array_equal(mask_a.numpy(), mask_b.numpy())


def test_repeat_is_endless_reproducible_and_numbers_steps_from_first_step():
    sampler = PoissonSampler(N, 30, seed=3)

    def steps(dataset, count):
        return [tuple(x.numpy()[m.numpy() > 0, 0, 0]) for (x, _), m in dataset.take(count)]

    endless = make_dataset(sampler, source(), repeat=True)
    assert int(endless.cardinality()) == tf.data.INFINITE_CARDINALITY
    rows = steps(endless, 3 * sampler.steps_per_epoch)
    assert len(set(rows)) == len(rows)  # fresh draws, epoch after epoch
    def later():
        return make_dataset(PoissonSampler(N, 30, seed=3), source(), first_step=5, repeat=True)

    assert steps(later(), 4) == steps(later(), 4) != rows[:4]  # a seeded rerun; another start

    class Steps:  # the sampler sees the step numbers from first_step on
        def draw(self, key, step):
            return sampling.padded_draw(tf.reshape(step, [1]), 1)

    numbered = sampling.draws(Steps(), sampler.key, first_step=5)
    assert [int(d["indices"][0]) for d in numbered.take(3)] == [5, 6, 7]
    with pytest.raises(ValueError, match="first_step=-1"):
        make_dataset(sampler, source(), first_step=-1)


def test_mismatched_first_dimensions_raise():
    x, y = source()
    sampler = PoissonSampler(N, 30)
    with pytest.raises(ValueError, match=r"arrays\[1\] with first dimension 299"):
        make_dataset(sampler, (x, y[:-1]))
    with pytest.raises(ValueError, match=r"arrays\['label'\] with first dimension 10"):
        make_dataset(sampler, {"image": x, "label": y[:10]})
    with pytest.raises(ValueError, match=r"num_examples \(200\)"):
        make_dataset(PoissonSampler(200, 30), (x, y))


def test_bad_arguments_raise():
    x, y = source()
    with pytest.raises(TypeError, match="sampler"):
        make_dataset(object(), (x, y))
    with pytest.raises(ValueError, match="first"):
        make_dataset(PoissonSampler(N, 30), (np.float32(1.0), y))
    with pytest.raises(ValueError, match="at least one"):
        make_dataset(PoissonSampler(N, 30), ())


def test_keras_fit_consumes_it():
    import keras

    x = np.random.default_rng(0).normal(size=(N, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    sampler = PoissonSampler(N, 50, seed=0)
    dataset = make_dataset(sampler, (x, y)).map(lambda xy, mask: (xy[0], xy[1], mask))
    keras.utils.set_random_seed(0)  # deterministic initial weights
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    steps = []
    counter = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: steps.append(counter.seen),
                                             on_train_batch_end=lambda batch, logs: setattr(counter, "seen", batch + 1))
    model.compile(optimizer=keras.optimizers.SGD(0.5),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    # 8 epochs: with 4 the accuracy (0.75 to 0.99 over sampler seeds 0-2) was
    # a matter of which batches were drawn; with 8 it is above 0.98 for each.
    history = model.fit(dataset, epochs=8, verbose=0, shuffle=False, callbacks=[counter])
    assert steps == [sampler.steps_per_epoch] * 8  # one fresh Poisson step per element
    losses = history.history["loss"]
    assert losses[-1] < 0.7 * losses[0]  # it learns y = [x0 > 0] from the gathered rows
    assert history.history["accuracy"][-1] > 0.9


def test_one_fashion_mnist_sized_epoch_is_fast():
    import time

    x = np.zeros((60000, 28, 28, 1), np.float32)
    y = np.zeros(60000, np.int64)
    dataset = make_dataset(PoissonSampler(60000, 2048, seed=0), (x, y))
    for _ in dataset:  # warm up
        pass
    start = time.perf_counter()
    steps = sum(1 for _ in dataset)
    assert steps == 29
    assert time.perf_counter() - start < 5.0


def test_iterators_do_not_rewrite_the_pipeline_holding_the_data():
    # tf.data's default static optimizations rewrite the pipeline's graph
    # when an iterator is made, and that graph holds the arrays the gather
    # reads: every fit serialized and copied its training data (about 100 ms
    # for 179 MB of records, python benchmarks/pipeline_start.py). Off, and
    # the steps draw the same records as with them on.
    from tfdp.data import ArraySource

    x, y = source()
    for arrays in [(x, y), ArraySource(x, y)]:
        dataset = make_dataset(PoissonSampler(N, 30, seed=3), arrays)
        assert dataset.options().experimental_optimization.apply_default_optimizations is False
        options = tf.data.Options()
        options.experimental_optimization.apply_default_optimizations = True
        rewritten = make_dataset(PoissonSampler(N, 30, seed=3), arrays).with_options(options)
        epochs = []
        for _ in range(2):  # a new iterator each: the iteration counter moves on
            steps = 0
            for ((xa, ya), ma), ((xb, yb), mb) in zip(dataset, rewritten):
                np.testing.assert_array_equal(ma.numpy(), mb.numpy())
                np.testing.assert_array_equal(xa.numpy(), xb.numpy())
                np.testing.assert_array_equal(ya.numpy(), yb.numpy())
                epochs.append(tuple(xa.numpy()[ma.numpy() > 0, 0, 0]))  # record ids
                steps += 1
            assert steps == 10
        assert len(set(epochs)) == 20  # both epochs drew fresh batches, on both


def test_epochs_do_not_wait_for_tf_data_autotuning(tmp_path):
    # Keras makes a new iterator at every epoch end; with autotuning on,
    # deleting the old one waited for its tuning thread (about 0.5 s at one
    # epoch end in two, python benchmarks/throughput.py --only tanh_cnn_2048).
    from tfdp.data import ArraySource

    x, y = source()
    for arrays in [(x, y), ArraySource(x, y)]:
        dataset = make_dataset(PoissonSampler(N, 30, seed=0), arrays)
        assert dataset.options().autotune.enabled is False
        assert sum(1 for _ in dataset) == 10  # and the map still runs
