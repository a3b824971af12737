"""Training from data on disk: throughput, memory, accuracy (issue 26).

Three measurements, one sub-command each:

throughput: Fashion-MNIST is written once to disk as a .npy memmap
    (`tfdp.data.write_records`) and as one ArrayRecord file (28x28 uint8
    pixels + label byte per record), then DP-SGD on the tanh CNN (README's
    model, batch 256) fits one epoch of `--steps` steps from in-memory
    arrays, from the memmap and from two RecordSources over the ArrayRecord
    file (decoded record by record by a `transform`, and a step at a time
    by a `batch_transform`), interleaved for `--rounds` rounds after a
    warm-up round,
    in one process. Examples/s are timed inside fit from the end of the 3rd
    step to the end of the last; the table gives the median over rounds and
    the ratio to in-memory arrays.
memory: a synthetic float32 .npy larger than 4 GB (`--gigabytes`, or
    `--rows` of `--width` features; written in chunks, every row distinct)
    is opened with mmap_mode="r" and a Dense model fits `--steps` DP steps
    of `--batch-size` (and `--physical-batch-size`) from it; a thread
    samples RssAnon + RssShmem (/proc/self/status) every 5 ms. Prints the file size
    and the anonymous memory before fit, at its peak during fit and the
    growth (the goal for data at scale: under 300 MB; `--read-cores`
    makes tfdp and tf.data plan reads for that many cores, to measure a
    larger machine's read-ahead on a small one).
accuracy: DP-SGD, tanh CNN, `tfdp train`'s Fashion-MNIST recipe (batch
    2048, lr 4, momentum 0.9, clip 0.1, 40 epochs, epsilon 3) with
    physical_batch_size 256, from in-memory arrays, a memmap (`fit(x, y)`
    with the memory-mapped arrays) or a RecordSource (`--source`), one seed
    per run; prints the accuracy on the test split's second half
    (as RESULTS.md) and on all of it. About 3 minutes on 2 CPU cores.

    python benchmarks/data_sources.py throughput --rounds 5 --steps 40
    python benchmarks/data_sources.py memory --gigabytes 4.5
    python benchmarks/data_sources.py memory --rows 120000 --width 2048 \
        --batch-size 2048 --physical-batch-size 256 --steps 20
    python benchmarks/data_sources.py accuracy --source memmap --seed 0
    python benchmarks/data_sources.py accuracy --source records --seed 1
"""

import argparse
import os
import statistics
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdp  # noqa: E402
from tfdp import recipes  # noqa: E402
from tfdp.data import RecordSource, load_fashion_mnist, read_records, write_records  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# -- on-disk copies of Fashion-MNIST --------------------------------------------


def write_array_record(path, x, y):
    """One record per example: 784 uint8 pixels then the label byte."""
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(path, "group_size:1")
    pixels = np.round(x.reshape(len(x), -1) * 255).astype(np.uint8)
    for row, label in zip(pixels, y):
        writer.write(row.tobytes() + bytes([int(label)]))
    writer.close()


def decode(record):
    data = np.frombuffer(record, np.uint8)
    return (data[:784].astype(np.float32) / 255.0).reshape(28, 28, 1), np.int64(data[784])


def decode_batch(records):
    data = np.frombuffer(b"".join(records), np.uint8).reshape(len(records), 785)
    pixels = (data[:, :784].astype(np.float32) / 255.0).reshape(-1, 28, 28, 1)
    return pixels, data[:, 784].astype(np.int64)


def array_record_source(path, batched=False):
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    records = ArrayRecordDataSource([path])
    if batched:
        return RecordSource(records, batch_transform=decode_batch)
    return RecordSource(records, transform=decode)


def on_disk(folder, x, y):
    """(memmap source, ArrayRecord source) of (x, y), written once into folder."""
    write_records(((x[i:i + 4096], y[i:i + 4096]) for i in range(0, len(x), 4096)),
                  os.path.join(folder, "npy"), batched=True)
    write_array_record(os.path.join(folder, "train.array_record"), x, y)
    return read_records(os.path.join(folder, "npy")), array_record_source(
        os.path.join(folder, "train.array_record"))


# -- throughput -------------------------------------------------------------------


class StepClock(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_end(self, batch, logs=None):
        float(logs["loss"])  # wait for the step
        self.times.append(time.perf_counter())


def dp_model(seed, input_layers):
    keras.utils.set_random_seed(seed)
    model = tfdp.DPSequential(input_layers)
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.0, seed=seed),
        loss=LOSS,
    )
    return model


def throughput(args):
    (x, y), _ = load_fashion_mnist()
    # the ArrayRecord copy stores uint8 pixels: train every kind on the same values
    x = np.round(x * 255).astype(np.uint8).astype(np.float32) / 255.0
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        started = time.perf_counter()
        memmap, records = on_disk(folder, x, y)
        print(f"wrote Fashion-MNIST to disk in {time.perf_counter() - started:.1f} s")
        batched = array_record_source(os.path.join(folder, "train.array_record"), batched=True)
        kinds = {"in-memory arrays": (x, y), "memmap (.npy)": (memmap,),
                 "RecordSource (ArrayRecord), transform": (records,),
                 "RecordSource (ArrayRecord), batch_transform": (batched,)}
        models = {name: dp_model(0, recipes.tanh_cnn()) for name in kinds}
        rates = {name: [] for name in kinds}
        for round_number in range(args.rounds + 1):
            for name, data in kinds.items():
                clock = StepClock()
                models[name].fit(*data, batch_size=args.batch_size, epochs=1,
                                 steps_per_epoch=args.steps, verbose=0, callbacks=[clock])
                steps = len(clock.times) - 3
                rate = steps * args.batch_size / (clock.times[-1] - clock.times[2])
                if round_number:  # round 0 traces the step
                    rates[name].append(rate)
        reads = {name: read_milliseconds(data[0], args.batch_size)
                 for name, data in kinds.items() if len(data) == 1}
    base = statistics.median(rates["in-memory arrays"])
    print(f"DP-SGD, tanh CNN, batch {args.batch_size}, {args.steps} steps, "
          f"median of {args.rounds} interleaved rounds; read ms: one step's "
          f"{args.batch_size} sampled records read alone (median of 50 draws)")
    print("| data | examples/s | vs in-memory | read ms |")
    print("|---|---|---|---|")
    for name, values in rates.items():
        median = statistics.median(values)
        read = f"{reads[name]:.1f}" if name in reads else "-"
        print(f"| {name} | {median:,.0f} | {median / base:.2f}x | {read} |")


def read_milliseconds(source, batch_size, draws=50):
    """Median time of `source.read_batch` for `draws` Poisson-sized draws."""
    rng = np.random.default_rng(0)
    out = source.empty_batch(2 * batch_size)
    times = []
    for _ in range(draws + 1):
        indices = np.flatnonzero(rng.random(len(source)) < batch_size / len(source))
        started = time.perf_counter()
        source.read_batch(indices, out)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times[1:])


# -- memory -----------------------------------------------------------------------


def rss_anon_mb():
    """RssAnon + RssShmem (MiB): resident memory no file backs (a shared
    anonymous mapping counts as RssShmem)."""
    found = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(("RssAnon:", "RssShmem:")):
                found[line.split(":")[0]] = int(line.split()[1]) / 1024
    if "RssAnon" not in found:
        raise RuntimeError("RssAnon not in /proc/self/status")
    return sum(found.values())


class PeakSampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = rss_anon_mb(), True

    def run(self):
        while self.running:
            self.peak = max(self.peak, rss_anon_mb())
            time.sleep(0.005)


def plan_reads_for(cores):
    """tfdp and tf.data plan the input pipeline's reads for `cores` cores."""
    from tfdp.data import poisson, reader

    reader._cores = lambda: cores  # pylint: disable=protected-access
    finish = poisson._finish  # pylint: disable=protected-access

    def with_threads(steps, dataset):
        options = tf.data.Options()
        options.threading.private_threadpool_size = cores
        return finish(steps, dataset).with_options(options)

    poisson._finish = with_threads  # pylint: disable=protected-access


def memory(args):
    width = args.width
    rows = args.rows or int(args.gigabytes * 2**30 / (4 * width)) + 1
    if args.read_cores:
        plan_reads_for(args.read_cores)
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = os.path.join(folder, "x.npy")
        mapped = np.lib.format.open_memmap(path, "w+", np.float32, (rows, width))
        chunk = 65536
        for start in range(0, rows, chunk):
            stop = min(rows, start + chunk)
            mapped[start:stop] = (np.arange(start, stop, dtype=np.float32)[:, None] % 97) / 97.0
        mapped.flush()
        del mapped
        size_gb = os.path.getsize(path) / 2**30
        x = np.load(path, mmap_mode="r")
        y = np.arange(rows) % 10
        model = dp_model(0, [keras.Input((width,)), keras.layers.Dense(64, activation="tanh"),
                             keras.layers.Dense(10)])
        before = rss_anon_mb()
        sampler = PeakSampler()
        sampler.start()
        model.fit(x, y, batch_size=args.batch_size, epochs=1, steps_per_epoch=args.steps,
                  physical_batch_size=args.physical_batch_size, verbose=0)
        sampler.running = False
        sampler.join()
    physical = f", physical {args.physical_batch_size}" if args.physical_batch_size else ""
    cores = f", reads planned for {args.read_cores} cores" if args.read_cores else ""
    print(f"memmap of {size_gb:.2f} GiB ({size_gb * 2**30 / 1e6:,.0f} MB; "
          f"{rows:,} x {width} float32), {args.steps} DP steps of batch {args.batch_size}"
          f"{physical}{cores}: anonymous memory {before:,.0f} MiB before fit, peak "
          f"{sampler.peak:,.0f} MiB during fit: +{sampler.peak - before:,.0f} MiB "
          f"(+{(sampler.peak - before) * 2**20 / 1e6:,.0f} MB; goal < 300)")


# -- accuracy ---------------------------------------------------------------------


def accuracy(args):
    """DP-SGD on the tanh CNN with `tfdp train`'s Fashion-MNIST recipe
    (`recipes.DEFAULTS`: batch 2048, lr 4, momentum 0.9, clip 0.1, epsilon 3),
    fed from disk in physical batches of 256; scored like RESULTS.md's rows
    (the test split's second half, and all of it)."""
    (x, y), (x_test, y_test) = load_fashion_mnist()
    settings = recipes.DEFAULTS["fashion_mnist"]
    batch_size = settings["batch_size"]
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        memmap, records = on_disk(folder, x, y)
        data = {"memory": (x, y), "memmap": memmap.arrays, "records": (records,)}[args.source]
        keras.utils.set_random_seed(args.seed)
        model = recipes.build_model("fashion_mnist")
        sigma = tfdp.accounting.calibrate_noise_multiplier(
            settings["epsilon"], settings["delta"], batch_size / len(x),
            args.epochs * round(len(x) / batch_size))
        model.compile(
            optimizer=tfdp.optimizers.DPSGD(
                settings["learning_rate"], momentum=settings["momentum"],
                l2_norm_clip=settings["l2_norm_clip"], noise_multiplier=sigma, seed=args.seed),
            loss=LOSS, metrics=["accuracy"],
        )
        started = time.perf_counter()
        model.fit(*data, batch_size=batch_size, physical_batch_size=args.physical_batch_size,
                  epochs=args.epochs, verbose=2)
        seconds = time.perf_counter() - started
    half = len(x_test) // 2
    held_out = model.evaluate(x_test[half:], y_test[half:], verbose=0)[1]
    full = model.evaluate(x_test, y_test, verbose=0)[1]
    print(f"source={args.source} seed={args.seed} epochs={args.epochs} "
          f"physical_batch_size={args.physical_batch_size} "
          f"accuracy held-out half={100 * held_out:.2f}% full test={100 * full:.2f}% "
          f"epsilon={model.privacy.epsilon(settings['delta']):.3f} fit seconds={seconds:.0f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("throughput")
    run.add_argument("--rounds", type=int, default=5)
    run.add_argument("--steps", type=int, default=40)
    run.add_argument("--batch-size", type=int, default=256)
    run = commands.add_parser("memory")
    run.add_argument("--gigabytes", type=float, default=4.5)
    run.add_argument("--rows", type=int, default=None, help="instead of --gigabytes")
    run.add_argument("--width", type=int, default=1024)
    run.add_argument("--batch-size", type=int, default=256)
    run.add_argument("--physical-batch-size", type=int, default=None)
    run.add_argument("--read-cores", type=int, default=None)
    run.add_argument("--steps", type=int, default=50)
    run = commands.add_parser("accuracy")
    run.add_argument("--source", choices=("memory", "memmap", "records"), default="memmap")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--epochs", type=int, default=40)
    run.add_argument("--physical-batch-size", type=int, default=256)
    for run in commands.choices.values():
        run.add_argument("--dir", default=None, help="folder for the files (default: temp)")
    args = parser.parse_args()
    {"throughput": throughput, "memory": memory, "accuracy": accuracy}[args.command](args)


if __name__ == "__main__":
    main()
