"""Training data on disk: memmaps, RecordSource, write_records / read_records."""

import importlib.util
import os
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.data import ArraySource, PoissonSampler, RecordSource, make_dataset
from tfdp.data import read_records, write_records

N, D, CLASSES = 600, 8, 3


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, D)).astype(np.float32)
    y = rng.integers(0, CLASSES, N)
    return x, y


def train(*data, seed=3, **fit_kwargs):
    keras.utils.set_random_seed(1)
    model = tfdp.DPSequential([keras.Input((D,)), keras.layers.Dense(CLASSES)])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(*data, batch_size=50, epochs=1, verbose=0, **fit_kwargs)
    return model


def weights(model):
    return [w.numpy() for w in model.trainable_weights]


class CountingRecords:
    """Per-record raw float32 files, logging every index read.

    Raw files, not .npy: np.load parses each header with ast, which on
    CPython 3.11.7 can raise "AST constructor recursion depth mismatch"
    when several threads parse at once (a CPython bug, not tfdp's).
    """

    def __init__(self, folder, x, y):
        self.folder, self.y, self.reads = folder, y, []
        self.lock = threading.Lock()
        for i, row in enumerate(x):
            row.astype(np.float32).tofile(folder / f"{i}.f32")
        self.shape = x.shape[1:]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, index):
        with self.lock:
            self.reads.append(index)
        row = np.fromfile(self.folder / f"{index}.f32", dtype=np.float32)
        return row.reshape(self.shape), self.y[index]


def rss_anon_mb():
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no RssAnon")


# -- memmaps ------------------------------------------------------------------


def test_memmap_batches_equal_in_memory_batches(data, tmp_path):
    x, y = data
    np.save(tmp_path / "x.npy", x)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    batches = [
        [(b[0].numpy(), b[1].numpy(), m.numpy()) for b, m in make_dataset(
            PoissonSampler(N, 50, seed=5), arrays)]
        for arrays in [(x, y), (mapped, y)]
    ]
    for (xa, ya, ma), (xb, yb, mb) in zip(*batches):
        real = ma == 1
        np.testing.assert_array_equal(ma, mb)
        np.testing.assert_array_equal(xa[real], xb[real])
        np.testing.assert_array_equal(ya[real], yb[real])


def test_fit_on_memmaps_reads_rows_not_the_file(tmp_path):
    """A 256 MB memmap: anonymous memory grows far less than the file.

    The old path (`tf.convert_to_tensor` on the whole array) grew it by
    the file size or more; checked against it when this test was written.
    """
    rows, width = 2048, 32768  # 256 MB of float32
    mapped = np.lib.format.open_memmap(tmp_path / "x.npy", "w+", np.float32, (rows, width))
    mapped[::64] = 1.0
    mapped.flush()
    del mapped
    x = np.load(tmp_path / "x.npy", mmap_mode="r")
    y = np.zeros(rows, np.int64)
    keras.utils.set_random_seed(1)
    model = tfdp.DPSequential([keras.Input((width,)), keras.layers.Dense(2)])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = rss_anon_mb()
    model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=4, verbose=0)
    assert rss_anon_mb() - before < 100, rss_anon_mb() - before


def mapped_resident_bytes(path):
    """Resident bytes of this process's mappings of the file at `path`
    (/proc/self/smaps): the pages of it something read."""
    total, current = 0, False
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                current = len(fields) >= 6 and fields[5] == str(path)
            elif current and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's smaps")
def test_fit_on_a_memmap_reads_only_its_sampled_rows(tmp_path):
    """A 1 GiB memmap (a sparse file), 3 steps of about 16 rows: the pages
    fit maps are those around the rows it read (the kernel maps up to a few
    hundred KB around each), tens of MB, not the file: no check,
    fingerprint or copy reads the whole array (issue 55, item 9). Control:
    summing its first 128 MiB maps them."""
    rows, width = 65536, 4096  # 16 KiB a row
    path = tmp_path / "x.npy"
    np.lib.format.open_memmap(path, "w+", np.float32, (rows, width))._mmap.close()  # holes
    x = np.load(path, mmap_mode="r")
    y = np.arange(rows) % 3
    keras.utils.set_random_seed(1)
    model = tfdp.DPSequential([keras.Input((width,)), keras.layers.Dense(3)])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=16, epochs=1, steps_per_epoch=3, verbose=0)
    size = os.path.getsize(path)
    touched = mapped_resident_bytes(path)
    assert touched < size / 8, f"{touched / 2**20:.0f} MiB of {size / 2**20:.0f} MiB mapped"
    float(x[:8192].sum())  # control: a read of 128 MiB maps them
    assert mapped_resident_bytes(path) - touched > 100 * 2**20


def test_parallel_reads_hold_a_bounded_number_of_large_batches(tmp_path, monkeypatch):
    """One read per core (tf.data's default) held 16 batches of 18 MB on 16
    cores; large batches are read at most READ_AHEAD_BYTES ahead, counted
    from the sampler's padded batch (a memmap's pipeline asks for it)."""
    from tfdp.data import reader

    asked = []
    plan = reader.parallel_reads
    monkeypatch.setattr(reader, "parallel_reads", lambda size: asked.append(size) or plan(size))
    np.save(tmp_path / "x.npy", np.zeros((400, 6), np.float32))
    sampler = PoissonSampler(400, 50, seed=0)
    make_dataset(sampler, (np.load(tmp_path / "x.npy", mmap_mode="r"), np.arange(400)))
    assert asked == [sampler.padded_size * (6 * 4 + 8)]  # float32 features, an int64 label
    assert plan(2048 * 2048 * 4 + 2048 * 8, cores=16) == 3
    assert plan(2**30, cores=16) == 1
    assert plan(2048 * 2048 * 4, cores=2) == tf.data.AUTOTUNE
    assert plan(256 * 784 * 4, cores=16) == tf.data.AUTOTUNE
    assert plan(None, cores=16) == tf.data.AUTOTUNE


def test_a_large_batch_is_its_own_mapping_and_reads_like_fancy_indexing(tmp_path):
    """A batch of 1 MiB or more is an anonymous mapping of its own (freed to
    the system with the batch, not kept in a read thread's malloc arena),
    filled by np.take straight from the memmap; out-of-range rows still
    raise."""
    import mmap

    from tfdp.data.sources import _batch_array

    large, small = _batch_array([300, 1024], np.float32), _batch_array([3, 4], np.float32)
    base = large
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base.obj, mmap.mmap) and large.flags.writeable
    assert small.base is None
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.normal(size=(500, 1024)).astype(np.float32))
    x = np.load(tmp_path / "x.npy", mmap_mode="r")
    source = ArraySource(x, np.arange(500))
    indices = rng.integers(0, 500, 300)
    out = source.empty_batch(300)
    source.read_batch(indices, out)
    np.testing.assert_array_equal(out[0], x[indices])
    np.testing.assert_array_equal(out[1], indices)
    with pytest.raises(IndexError):
        source.read_batch(np.array([3, 500]), source.empty_batch(2))


def test_fit_on_memmaps_equals_fit_on_arrays(data, tmp_path):
    x, y = data
    np.save(tmp_path / "x.npy", x)
    mapped = np.memmap(tmp_path / "raw", np.float32, "w+", shape=x.shape)
    mapped[:] = x
    expected = weights(train(x, y))
    for x_disk in (np.load(tmp_path / "x.npy", mmap_mode="r"), mapped):
        for got, want in zip(weights(train(x_disk, y)), expected):
            np.testing.assert_array_equal(got, want)
    assert not np.array_equal(weights(train(x, y, seed=4))[0], expected[0])  # control


# -- RecordSource ---------------------------------------------------------------


def test_record_source_reads_only_the_sampled_records(data, tmp_path):
    x, _ = data
    records = CountingRecords(tmp_path, x, np.arange(N))  # label = record index
    source = RecordSource(records, num_threads=4)
    assert records.reads == [0]  # the spec comes from the first record
    records.reads.clear()
    sampled = []
    for (xb, yb), mask in make_dataset(PoissonSampler(N, 50, seed=2), source):
        real = mask.numpy() == 1
        np.testing.assert_array_equal(xb.numpy()[real], x[yb.numpy()[real]])
        sampled.extend(yb.numpy()[real].tolist())
    assert len(sampled) > 0
    assert sorted(records.reads) == sorted(sampled)  # nothing else was read


def test_fit_on_a_file_reading_source_equals_fit_on_arrays(data, tmp_path):
    x, y = data
    records = CountingRecords(tmp_path, x, y)
    got = weights(train(RecordSource(records)))
    for a, b in zip(got, weights(train(x, y))):
        np.testing.assert_array_equal(a, b)
    # About one epoch of reads: N records expected, plus the spec and build
    # reads and the batches the pipeline had read ahead when training ended
    # (up to PREFETCHED_STEPS + one a core, of 50 records expected each).
    ahead = (tfdp.data.poisson.PREFETCHED_STEPS + (os.cpu_count() or 1)) * 50
    assert 0.8 * N < len(records.reads) < 1.2 * N + ahead


def test_fit_on_a_tfds_array_record_source(tmp_path, installed):
    """The batch read (`__getitems__`) of a tfds ArrayRecord source, offline.

    tensorflow-datasets is in the `test` extra: under CI=true a missing
    install fails this test instead of skipping it (a skip in CI once hid
    that this path was never run).
    """
    spec = importlib.util.find_spec("tensorflow_datasets")
    installed(spec.origin if spec else "the Python package tensorflow_datasets",
              "pip install -e '.[test]' (tensorflow-datasets)")
    import tensorflow_datasets as tfds

    class TinyRecords(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(
                builder=self,
                features=tfds.features.FeaturesDict({
                    "image": tfds.features.Tensor(shape=(D,), dtype=np.float32),
                    "label": tfds.features.ClassLabel(num_classes=CLASSES),
                }),
            )

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples()}

        def _generate_examples(self):
            for i in range(200):
                yield i, {"image": np.full(D, i / 200, np.float32), "label": i % CLASSES}

    TinyRecords(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    records = tfds.data_source("tiny_records", data_dir=str(tmp_path), split="train")
    batch_reads = []
    read = type(records).__getitems__

    def spy(self, indices):
        batch_reads.append(list(indices))
        return read(self, indices)

    source = RecordSource(records, transform=lambda item: (item["image"], item["label"]))
    assert len(source) == 200
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(records), "__getitems__", spy)
        model = train(source)
        out = source.empty_batch(3)
        source.read_batch(np.array([5, 150, 7]), out)
    expected = [records[i] for i in (5, 150, 7)]  # one by one (tfds orders records by key hash)
    np.testing.assert_array_equal(out[0], np.stack([e["image"] for e in expected]))
    np.testing.assert_array_equal(out[1], [e["label"] for e in expected])
    generated = np.round(out[0][:, 0] * 200).astype(int)
    np.testing.assert_array_equal(out[1], generated % CLASSES)  # each row is one record's
    assert len(batch_reads) >= 4 and batch_reads[-1] == [5, 150, 7]  # one batch read a step
    assert model.privacy.steps == 4  # round(200 / 50) Poisson steps
    assert np.isfinite(model.privacy.epsilon(1e-5))


class ByteRecords:
    """Each record as raw bytes (x as float32, then the label as int64), the
    way an ArrayRecord file stores serialized examples."""

    def __init__(self, x, y):
        self.rows = [a.astype(np.float32).tobytes() + np.int64(b).tobytes() for a, b in zip(x, y)]
        self.batches = 0

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]

    def decode(self, item):
        return np.frombuffer(item[:-8], np.float32), np.frombuffer(item[-8:], np.int64)[0]

    def decode_batch(self, items):
        self.batches += 1
        data = np.frombuffer(b"".join(items), np.uint8).reshape(len(items), -1)
        return data[:, :-8].copy().view(np.float32), data[:, -8:].copy().view(np.int64)[:, 0]


def test_batch_transform_gives_the_per_record_transforms_batches(data):
    x, y = data
    records = ByteRecords(x, y)
    per_record = RecordSource(records, transform=records.decode)
    batched = RecordSource(records, batch_transform=records.decode_batch)
    assert batched.element_spec == per_record.element_spec
    np.testing.assert_array_equal(batched[7][0], x[7])
    sampler = lambda: PoissonSampler(N, 50, seed=4)  # noqa: E731
    pairs = zip(make_dataset(sampler(), per_record), make_dataset(sampler(), batched))
    for ((xa, ya), ma), ((xb, yb), mb) in pairs:
        np.testing.assert_array_equal(ma, mb)
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    for a, b in zip(weights(train(batched)), weights(train(x, y))):
        np.testing.assert_array_equal(a, b)
    assert records.batches > 5  # one call per step, not per record


def test_a_batch_transform_that_does_not_match_record_0_is_named():
    x = np.zeros((40, D), np.float32)
    records = ByteRecords(x, np.zeros(40, np.int64))

    def short_rows(items):
        x_batch, y_batch = records.decode_batch(items)
        return (x_batch[:, :-1] if len(items) > 1 else x_batch), y_batch

    # A batch of two records is decoded when the source is made, so a
    # transform that only goes wrong on batches is found there.
    with pytest.raises(ValueError, match=r"batch_transform of records \[0, 1\] does not "
                       r"match record 0 at x: expected shape \(2, 8\)"):
        RecordSource(records, batch_transform=short_rows)
    with pytest.raises(ValueError, match=r"record 0 .* batch_transform <lambda> of one record to be a tuple"):
        RecordSource(records, batch_transform=lambda items: [records.decode_batch(items)[0]])
    with pytest.raises(ValueError, match=r"Expected the batch_transform of records \[0, 1\] "
                       r"to be a tuple \(x, y\)"):
        RecordSource(records, batch_transform=lambda items: (
            records.decode_batch(items) if len(items) == 1 else [records.decode_batch(items)[0]]))
    wrong_later = RecordSource(records, batch_transform=lambda items: (
        short_rows(items) if len(items) > 2 else records.decode_batch(items)))
    with pytest.raises(ValueError, match=r"batch_transform of records \[4, 9, 11\] does not "
                       r"match record 0 at x: expected shape \(3, 8\)"):
        wrong_later.read_batch(np.array([4, 9, 11]), wrong_later.empty_batch(3))
    with pytest.raises(ValueError, match="not both"):
        RecordSource(records, transform=records.decode, batch_transform=records.decode_batch)
    with pytest.raises(TypeError, match="Received: batch_transform=3"):
        RecordSource(records, batch_transform=3)


def test_a_mismatched_record_is_an_error_naming_its_index():
    records = [(np.zeros(D, np.float32), 0)] * 20 + [(np.zeros(D + 1, np.float32), 0)]
    source = RecordSource(records)
    with pytest.raises(ValueError, match=r"Record 20 does not match record 0 at x"):
        source[20]
    with pytest.raises(tf.errors.OpError, match=r"Record (20|41|62) does not match"):
        train(RecordSource(records * 3), seed=0, steps_per_epoch=3)  # q = 50 / 63: one is read


def test_a_missing_file_is_an_error_naming_the_record(data, tmp_path):
    x, y = data
    records = CountingRecords(tmp_path, x[:100], y[:100])
    (tmp_path / "37.f32").unlink()
    source = RecordSource(records)
    with pytest.raises(FileNotFoundError, match="Reading record 37 of CountingRecords failed"):
        source[37]
    with pytest.raises(tf.errors.OpError, match="Reading record 37"):
        train(RecordSource(records), steps_per_epoch=20)  # q = 1/2: 37 is read


def test_bad_records_and_arguments_are_refused_clearly(data):
    x, y = data
    with pytest.raises(TypeError, match="records of type int"):
        RecordSource(5)
    with pytest.raises(ValueError, match="tfds dict"):
        RecordSource([{"image": x[0], "label": 1}])
    with pytest.raises(ValueError, match="pass it as x alone"):
        train(RecordSource(list(zip(x, y))), y)
    with pytest.raises(ValueError, match="validation_split"):
        train(RecordSource(list(zip(x, y))), validation_split=0.1)


def test_mechanisms_that_read_every_record_refuse_data_on_disk(data):
    x, y = data
    model = tfdp.DPSequential([keras.Input((D,)), keras.layers.Dense(CLASSES)])
    model.compile(
        optimizer=tfdp.optimizers.DPIS(0.1, target_epsilon=3.0, target_delta=1e-5, epochs=1, sigma_n=12.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    with pytest.raises(ValueError, match="DPIS .*RecordSource"):
        model.fit(RecordSource(list(zip(x, y))), batch_size=50, verbose=0)


# -- pipelines: refused, converted once -----------------------------------------


@pytest.mark.parametrize("kind", ["dataset", "generator"])
def test_pipelines_are_refused_with_the_way_to_convert(data, kind):
    x, y = data
    pipeline = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    if kind == "generator":
        pipeline = (b for b in pipeline.as_numpy_iterator())
    with pytest.raises(ValueError) as error:
        train(pipeline)
    for words in ("RecordSource", "mmap_mode", "tfdp.data.write_records", "read_records"):
        assert words in str(error.value)


def test_write_records_converts_a_pipeline_once(tmp_path):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 255, (3000, 6, 6), np.uint8)
    labels = rng.integers(0, CLASSES, 3000)
    pipeline = tf.data.Dataset.from_tensor_slices((images, labels)).map(
        lambda image, label: (tf.cast(image, tf.float32) / 255.0, label, 2.0)
    )
    assert write_records(pipeline.batch(128), tmp_path / "train", batched=True) == 3000
    source = read_records(tmp_path / "train")
    x, y, w = source.arrays
    assert isinstance(x.base, np.memmap) or isinstance(x, np.memmap)
    np.testing.assert_allclose(x, images / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(y, labels)
    np.testing.assert_array_equal(w, np.full(3000, 2.0, np.float32))
    with pytest.raises(ValueError, match="Records already exist"):
        write_records(pipeline, tmp_path / "train")
    assert write_records(pipeline.take(5), tmp_path / "unbatched") == 5
    np.testing.assert_array_equal(read_records(tmp_path / "unbatched").arrays[1], labels[:5])

    keras.utils.set_random_seed(1)
    model = tfdp.DPSequential([keras.Input((6, 6)), keras.layers.Flatten(), keras.layers.Dense(3)])
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(source, batch_size=300, epochs=1, verbose=0)
    assert model.privacy.steps == 10


def test_write_records_names_a_mismatched_element(tmp_path):
    examples = [(np.zeros(3, np.float32), 1)] * 4 + [(np.zeros(4, np.float32), 1)]
    with pytest.raises(ValueError, match="Element 4 does not match element 0 at x"):
        write_records(examples, tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="write_records"):
        read_records(tmp_path / "bad")  # an interrupted conversion is not readable


def test_array_source_checks_lengths(data):
    x, y = data
    with pytest.raises(ValueError, match="same first dimension"):
        ArraySource(x, y[:-1])


@pytest.mark.parametrize("kind", ["record_source", "memmap", "read_records"])
def test_sadpsgd_refuses_data_on_disk_by_name(data, tmp_path, kind):
    """SA-DPSGD compares every record with its energy set: data on disk is
    refused by name before any step (it was said to fail with IndexError)."""
    x, y = data
    if kind == "record_source":
        training = (RecordSource(list(zip(x, y))),)
    elif kind == "memmap":
        np.save(tmp_path / "x.npy", x)
        training = (np.load(tmp_path / "x.npy", mmap_mode="r"), y)
    else:
        write_records(list(zip(x, y)), tmp_path / "records")
        training = (read_records(tmp_path / "records"),)
    model = tfdp.DPSequential([keras.Input((D,)), keras.layers.Dense(CLASSES)])
    model.compile(optimizer=tfdp.optimizers.SADPSGD(
        0.1, l2_norm_clip=1.0, noise_multiplier=1.0, public_energy_data=(x[:10] + 100.0, y[:10])),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="SADPSGD compares every training record.*in memory"):
        model.fit(*training, batch_size=50, epochs=1, verbose=0)
    assert model.privacy.steps == 0
