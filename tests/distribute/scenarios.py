"""DP training under tf.distribute, run in a fresh process (not collected by pytest).

    python scenarios.py mirrored R OUT.npz  # MirroredStrategy on R logical CPUs
    python scenarios.py worker 2 OUT.npz    # one MultiWorkerMirroredStrategy worker
                                            # (TF_CONFIG set by the caller)

Logical devices must be configured before TensorFlow initialises, and a
MultiWorkerMirroredStrategy must be created before any op runs (two
MirroredStrategies over different device sets cannot share a process
either: their collectives clash), so each runs in its own process. Results
go to OUT.npz; the tests assert on them.
"""

import contextlib
import json
import os
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

MODE, REPLICAS = sys.argv[1], int(sys.argv[2])
if MODE == "mirrored":
    _cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        _cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS
    )
    STRATEGY = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
else:
    STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()
if STRATEGY.num_replicas_in_sync != REPLICAS:
    raise SystemExit(f"expected {REPLICAS} replicas, got {STRATEGY.num_replicas_in_sync}")

import absl.logging  # noqa: E402
import keras  # noqa: E402

import tfdp  # noqa: E402
from tfdp import distribute  # noqa: E402
from tfdp.mechanisms import adaptive_noise as ada  # noqa: E402
from tfdp.per_example import compute_per_example_gradients  # noqa: E402

absl.logging.set_verbosity("error")

SIGMA, CLIP = 1.3, 0.7
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


# -- test doubles -----------------------------------------------------------


class NoiselessDPSGD(tfdp.optimizers.DPSGD):
    def noise_stddev(self):
        return 0.0


class NoiselessDPOptimizer(tfdp.optimizers.DPOptimizer):
    def noise_stddev(self):
        return 0.0


class NoiselessAdaDP(tfdp.optimizers.AdaDP):
    def noise_stddev(self):
        return 0.0

    def whitened_noise_multiplier(self):
        return 0.0


@contextlib.contextmanager
def timed(label):
    """Logs a section's wall and CPU seconds to the process log (kept by
    _launch on failure): on a loaded machine the CPU time is the cost."""
    start, start_cpu = time.perf_counter(), time.process_time()
    yield
    print(f"{label}: {time.perf_counter() - start:.1f} s, "
          f"{time.process_time() - start_cpu:.1f} s CPU", flush=True)


@contextlib.contextmanager
def patched(name, value):
    """Replaces `tfdp.distribute.<name>` (negative controls)."""
    original = getattr(distribute, name)
    setattr(distribute, name, value)
    try:
        yield
    finally:
        setattr(distribute, name, original)


def logged(record, *tensors):
    """`tensors`, with `record(*arrays)` called on their values when they are
    computed (in the input pipeline's graph: the draws happen there)."""
    done = tf.numpy_function(lambda *arrays: record(*arrays) or np.int64(0), list(tensors),
                             tf.int64)
    with tf.control_dependencies([done]):
        return tuple(tf.identity(t) for t in tensors)


def scope(replicas):
    return STRATEGY.scope() if replicas > 1 else contextlib.nullcontext()


# -- 1. noiseless training equals single-device training ---------------------

EXACT_OPTIMIZERS = {
    # momentum + classic weight decay added after the noise (1/R per replica)
    "dpsgd": lambda: NoiselessDPSGD(
        0.5, momentum=0.9, l2_norm_clip=0.5, noise_multiplier=SIGMA,
        weight_decay=0.05, weight_decay_placement="after_noise", seed=7,
    ),
    "adam": lambda: NoiselessDPOptimizer(
        keras.optimizers.Adam(0.05), l2_norm_clip=0.5, noise_multiplier=SIGMA,
        weight_decay=0.05, seed=7,
    ),
    # threshold 0: the adaptive phase (local clipping from s) starts at step 2
    "adadp": lambda: NoiselessAdaDP(
        0.02, l2_norm_clip=0.5, noise_multiplier=SIGMA, local_clip_threshold=0.0,
        weight_decay=0.05, weight_decay_placement="after_noise", seed=7,
    ),
}


def exact_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=96)
    sample_weight = rng.uniform(0.5, 1.5, size=96).astype(np.float32)
    return x, y, sample_weight


def exact_model():
    model = tfdp.DPSequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]
    )
    rng = np.random.default_rng(1)
    for variable in model.trainable_variables:
        variable.assign(rng.normal(size=variable.shape).astype(np.float32) * 0.5)
    return model


def train_exact(name, replicas, physical_batch_size=None, users=False):
    """8 seeded Poisson steps; returns (weights, steps, epsilon, first-epoch
    [loss, nonfinite_examples]). With `users`: user-level, 3 records of each
    sampled user of 20 (a replica's share is whole users)."""
    x, y, sample_weight = exact_data()
    # Three non-finite rows: dropped and counted, the same way on every replica count.
    x[[5, 40, 77]] = [[np.nan] * 6, [np.inf] + [0.0] * 5, [0.0] * 5 + [-np.inf]]
    with scope(replicas):
        model = exact_model()
        model.compile(optimizer=EXACT_OPTIMIZERS[name](), loss=LOSS)
    by_user = dict(user_ids=np.arange(len(x)) % 20, examples_per_user=3, batch_size=5,
                   steps_per_epoch=4) if users else dict(batch_size=24)
    history = model.fit(
        x, y, sample_weight=sample_weight, epochs=2, verbose=0,
        physical_batch_size=physical_batch_size, **by_user,
    )
    weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    logs = np.array([history.history["loss"][0], history.history["nonfinite_examples"][0]])
    return weights, model.privacy.steps, model.privacy.epsilon(1e-5), logs


class CountingRecords:
    """The exact data as records, logging every index the training reads:
    fit's checks before the first step read record 0 on the main thread
    (the element spec, the model build, the label check), the steps read
    on the input pipeline's threads."""

    def __init__(self, x, y, sample_weight):
        self.rows = list(zip(x, y, sample_weight))
        self.reads = []

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        if threading.current_thread() is not threading.main_thread():
            self.reads.append(int(index))
        return self.rows[index]


def train_exact_source(replicas):
    """`train_exact("dpsgd")` from a RecordSource: (weights, steps, epsilon,
    this worker's reads, this worker's shares of the drawn batches)."""
    x, y, sample_weight = exact_data()
    x[[5, 40, 77]] = [[np.nan] * 6, [np.inf] + [0.0] * 5, [0.0] * 5 + [-np.inf]]
    records = CountingRecords(x, y, sample_weight)
    source = tfdp.data.RecordSource(records)
    shares_seen = []
    original = distribute.replica_shares

    def recording(indices, mask, num_replicas):  # this worker's local replicas
        rows, rows_mask = original(indices, mask, num_replicas)  # [R, L / R] each
        return logged(lambda r, m: shares_seen.extend(int(i) for i in r[m > 0]),
                      rows, rows_mask)

    with scope(replicas):
        model = exact_model()
        model.compile(optimizer=EXACT_OPTIMIZERS["dpsgd"](), loss=LOSS)
    with patched("replica_shares", recording):
        model.fit(source, batch_size=24, epochs=2, verbose=0)
    weights = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    reads = np.asarray(records.reads, np.int64)
    return weights, model.privacy.steps, model.privacy.epsilon(1e-5), reads, np.asarray(shares_seen)


# -- 2. the global update's noise -------------------------------------------

NOISE_BATCH = 8


def noise_model():
    # x = 0 and no bias: every per-example gradient is exactly 0, so the
    # update is -learning_rate * noise / b.
    model = tfdp.DPSequential([keras.Input((100,)), keras.layers.Dense(400, use_bias=False)])
    model.trainable_variables[0].assign(np.zeros((100, 400), np.float32))
    return model


def global_noise(replicas, seed=11):
    """One DP-SGD step on zero gradients; returns noise / (sigma C / b), ideally N(0, 1)."""
    x = np.zeros((16, 100), np.float32)
    y = np.zeros((16, 400), np.float32)
    with scope(replicas):
        model = noise_model()
        model.compile(
            optimizer=tfdp.optimizers.DPSGD(
                1.0, l2_norm_clip=CLIP, noise_multiplier=SIGMA, seed=seed
            ),
            loss="mse",
        )
    model.fit(x, y, batch_size=NOISE_BATCH, epochs=1, steps_per_epoch=1, verbose=0)
    update = -model.trainable_variables[0].numpy().ravel()
    return update / (SIGMA * CLIP / NOISE_BATCH)


def _replica_parts(model):
    """Each local replica's `privatize` output on zero gradients (its noise part)."""
    strategy = STRATEGY

    @tf.function(autograph=False)  # straight-line code, traced as Keras traces a train step
    def parts():
        def replica_fn():
            x = tf.zeros((NOISE_BATCH, 100))
            y = tf.zeros((NOISE_BATCH, 400))
            weights = tf.ones([NOISE_BATCH])
            per_example, _, _ = compute_per_example_gradients(
                model, x, y, weights, model._per_example_loss
            )
            step_info = {"mask": weights, "expected_batch_size": tf.constant(float(NOISE_BATCH))}
            grads, _ = model.optimizer.privatize(per_example, step_info)
            return grads[0]

        return strategy.experimental_local_results(strategy.run(replica_fn))

    return np.stack([p.numpy().ravel() for p in parts()])


def replica_noise(replicas, seed=11):
    """Each local replica's part of one step's noise, in units of sigma C / b."""
    with STRATEGY.scope():
        model = noise_model()
        model.compile(
            optimizer=tfdp.optimizers.DPSGD(
                1.0, l2_norm_clip=CLIP, noise_multiplier=SIGMA, seed=seed
            ),
            loss="mse",
        )
        model.optimizer.build(model.trainable_variables)
    return _replica_parts(model) / (SIGMA * CLIP / NOISE_BATCH)


def adadp_replica_noise(replicas, seed=11):
    """AdaDP's adaptive-phase noise parts, each coordinate in units of its sigma_j / b."""
    with STRATEGY.scope():
        model = noise_model()
        model.compile(
            optimizer=tfdp.optimizers.AdaDP(
                1.0, l2_norm_clip=CLIP, noise_multiplier=SIGMA, local_clip_threshold=0.0,
                seed=seed,
            ),
            loss="mse",
        )
        optimizer = model.optimizer
        optimizer.build(model.trainable_variables)
        moments = np.random.default_rng(5).uniform(0.05, 0.2, size=(100, 400)).astype(np.float32)
        optimizer.second_moments(model.trainable_variables)[0].assign(moments)
    bounds = ada.clip_bounds([tf.constant(moments)], optimizer.local_clip_factor, CLIP)
    sigma_j = ada.noise_stddevs(bounds, SIGMA, moments.size)[0].numpy().ravel()
    return _replica_parts(model) / (sigma_j / NOISE_BATCH)


# -- 3. refusals --------------------------------------------------------------


def refusal_messages(replicas):
    x, y, _ = exact_data()
    public = (x[:10] + 100.0, y[:10])
    candidates = {
        "sadpsgd": lambda: tfdp.optimizers.SADPSGD(
            0.1, l2_norm_clip=1.0, noise_multiplier=1.0, public_energy_data=public, seed=1
        ),
        "dpis": lambda: tfdp.optimizers.DPIS(
            0.1, l2_norm_clip=1.0, target_epsilon=5.0, epochs=1, sigma_n=10.0, seed=1
        ),
        "clipnorm": lambda: tfdp.optimizers.DPOptimizer(
            keras.optimizers.SGD(0.1, clipnorm=1.0), l2_norm_clip=1.0, noise_multiplier=1.0
        ),
        "steps_per_execution": lambda: tfdp.optimizers.DPSGD(
            0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
    }
    messages = {}
    for name, make in candidates.items():
        with scope(replicas):
            model = exact_model()
            model.compile(optimizer=make(), loss=LOSS,
                          steps_per_execution=2 if name == "steps_per_execution" else 1)
        try:
            model.fit(x, y, batch_size=24, epochs=1, verbose=0)
            messages[name] = "TRAINED"
        except ValueError as error:
            messages[name] = f"{str(error)} | steps={model.privacy.steps}"
    return messages


# -- 4. unseeded sampling: one global batch per step, split once -------------


def unseeded_draws(replicas, fits=2):
    """Records the global draws (indices, mask) and this process's shares.
    The fits train one model (traced once): each fit must draw its own seed."""
    x, y, _ = exact_data()
    records = []
    original = distribute.worker_shard

    def recording(indices, mask, *args):  # the global draw, before the worker's shard
        indices, mask = logged(lambda i, m: records.append((i.copy(), m.copy())), indices, mask)
        return original(indices, mask, *args)

    per_fit = []
    with scope(replicas):
        model = exact_model()
        model.compile(
            optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
            loss=LOSS,
        )
    with patched("worker_shard", recording):
        for _ in range(fits):
            records.clear()
            model.fit(x, y, batch_size=24, epochs=1, steps_per_epoch=4, verbose=0)
            # the pipeline prefetches ahead; the first 4 draws are the steps
            draws = np.full((4, len(x)), -1, np.int64)
            for step, (indices, mask) in enumerate(records[:4]):
                real = indices[mask > 0]
                draws[step, : len(real)] = real
            per_fit.append(draws)
    return np.stack(per_fit)  # [fits, 4 steps, N]: sampled indices, -1 after


def mismatched_settings(task):
    """fit on two workers whose settings differ in one thing each (worker 1
    has sigma 2x, then batch 25 for 24, then Adam for SGD): both must refuse
    before a step. Returns "message | steps=..." per case."""
    x, y, _ = exact_data()
    cases = {
        "sigma": (lambda: tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0,
                                                noise_multiplier=1.0 + task), 24),
        "batch": (lambda: tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
                  24 + task),
        "optimizer": (lambda: tfdp.optimizers.DPOptimizer(
            [keras.optimizers.SGD(0.1), keras.optimizers.Adam(0.1)][task],
            l2_norm_clip=1.0, noise_multiplier=1.0), 24),
    }
    messages = []
    for make_optimizer, batch_size in cases.values():
        with scope(2):
            model = exact_model()
            model.compile(optimizer=make_optimizer(), loss=LOSS)
        try:
            model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
            messages.append(f"TRAINED | steps={model.privacy.steps}")
        except ValueError as error:
            messages.append(f"{error} | steps={model.privacy.steps}")
    return np.array(messages)


# -- 5. the rest of Keras under the strategy ---------------------------------


def keras_paths(replicas):
    """fit with validation data, then evaluate and predict: [val_loss, loss, rows]."""
    x, y, _ = exact_data()
    with scope(replicas):
        model = exact_model()
        model.compile(
            optimizer=tfdp.optimizers.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=3),
            loss=LOSS,
        )
    history = model.fit(x, y, batch_size=24, epochs=1, validation_data=(x[:40], y[:40]), verbose=0)
    evaluated = model.evaluate(x[:40], y[:40], verbose=0)
    predicted = model.predict(x[:10], verbose=0)
    return np.array([history.history["val_loss"][0], evaluated, len(predicted)])


# -- 6. DP-BandMF: every replica draws the same noise and adds 1/R of it -------


def bandmf_optimizer(seed=7, noise_state=None, bands=3):
    return tfdp.optimizers.DPBandMF(
        keras.optimizers.SGD(0.5, momentum=0.9), l2_norm_clip=0.5, noise_multiplier=SIGMA,
        bands=bands, weight_decay=0.05, weight_decay_placement="after_noise", seed=seed,
        noise_state=noise_state,
    )


def fixed_order_pipeline(shuffle_seed=3, batch_size=24):
    x, y, sample_weight = exact_data()
    return (tf.data.Dataset.from_tensor_slices((x, y, sample_weight))
            .shuffle(len(x), seed=shuffle_seed, reshuffle_each_iteration=False)
            .batch(batch_size, drop_remainder=True))


def fit_bandmf(model, mode, epochs=2, initial_epoch=0, shuffle_seed=3, batch_size=24):
    """A fixed order of 4 batches of 24 (or 96 // batch_size of batch_size),
    or cyclic Poisson (expected batch 8)."""
    if mode == "fixed":
        model.fit(fixed_order_pipeline(shuffle_seed, batch_size), epochs=epochs,
                  initial_epoch=initial_epoch, verbose=0)
    else:
        x, y, sample_weight = exact_data()
        model.fit(x, y, sample_weight=sample_weight, batch_size=8, epochs=epochs,
                  initial_epoch=initial_epoch, verbose=0)


def flat_weights(model):
    return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])


def train_bandmf(mode, replicas, **fit_args):
    """Seeded DP-BandMF with noise (3 bands, momentum, decay after the noise):
    (weights, steps, epsilon)."""
    with scope(replicas):
        model = exact_model()
        model.compile(optimizer=bandmf_optimizer(), loss=LOSS)
    fit_bandmf(model, mode, **fit_args)
    return flat_weights(model), model.privacy.steps, model.privacy.epsilon(1e-5)


def resumed_bandmf(replicas, folder):
    """One epoch of the fixed order with a noise state file, then a new
    optimizer resumes the stream from the file for the second epoch:
    (the file's histories after epoch 1, the final weights)."""
    path = os.path.join(folder, f"noise_state_{replicas}.npz")
    with scope(replicas):
        model = exact_model()
        model.compile(optimizer=bandmf_optimizer(noise_state=path), loss=LOSS)
    fit_bandmf(model, "fixed", epochs=1)
    with np.load(path) as saved:
        history = np.concatenate([saved[k].ravel() for k in sorted(saved.files)
                                  if k.startswith("history_")])
    with scope(replicas):
        model.compile(optimizer=bandmf_optimizer(noise_state=path), loss=LOSS)
    fit_bandmf(model, "fixed", epochs=2, initial_epoch=1)
    return history, flat_weights(model)


def bandmf_global_noise(replicas, shared_key=True):
    """One fixed-order step of DP-BandMF with bands = 1 on zero gradients,
    unseeded: noise / (sigma C / b), N(0, 1) when every replica adds 1/R of
    the same draw. `shared_key=False` (negative control): each worker keeps
    its own key, as a DP-SGD optimizer does."""
    x = np.zeros((16, 100), np.float32)
    y = np.zeros((16, 400), np.float32)
    with scope(replicas):
        model = noise_model()
        model.compile(optimizer=tfdp.optimizers.DPBandMF(
            keras.optimizers.SGD(1.0), l2_norm_clip=CLIP, noise_multiplier=SIGMA, bands=1),
            loss="mse")
    agree = tfdp.optimizers.DPBandMF.agree_with_workers
    if not shared_key:
        tfdp.optimizers.DPBandMF.agree_with_workers = tfdp.optimizers.DPOptimizer.agree_with_workers
    try:
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16, drop_remainder=True),
                  epochs=1, verbose=0)
    finally:
        tfdp.optimizers.DPBandMF.agree_with_workers = agree
    return -model.trainable_variables[0].numpy().ravel() / (SIGMA * CLIP / 16)


def bandmf_mismatched_pipelines(task):
    """Worker 1 shuffles with another seed: "message | steps=..."."""
    with scope(2):
        model = exact_model()
        model.compile(optimizer=bandmf_optimizer(), loss=LOSS)
    try:
        fit_bandmf(model, "fixed", shuffle_seed=3 + task)
        return f"TRAINED | steps={model.privacy.steps}"
    except ValueError as error:
        return f"{error} | steps={model.privacy.steps}"


def bandmf_shared_noise_state(folder):
    """Both workers write one `noise_state` path (as on a shared file
    system), 2 epochs of 4 steps: the model step of the state kept as
    `.prev` (the epoch before the last, for a resume one backup behind)."""
    path = os.path.join(folder, "shared_noise_state.npz")
    with scope(2):
        model = exact_model()
        model.compile(optimizer=bandmf_optimizer(noise_state=path), loss=LOSS)
    fit_bandmf(model, "fixed", epochs=2)
    meta = np.load(path + ".prev")["meta"]
    meta = json.loads(bytes(meta).decode("utf-8"))
    return int(meta["start"]) + int(meta["steps"])


def bandmf_mismatched_noise(task):
    """Worker 1 draws DP-BandMF's z_t from another key (seed 8 for 7; no seed
    for 7: it would take the chief's secret) or plans another number of
    epochs (the default coefficients come from the planned steps): each
    worker would add half of its own w_t. "message | steps=..." per case.
    The epochs case goes last: on code that lets it train, worker 0 stops
    an epoch before worker 1, whose next collective then fails."""
    cases = ((dict(seed=7 + task), 2), (dict(seed=None if task else 7), 2),
             (dict(seed=7), 2 + task))
    messages = []
    for optimizer_args, epochs in cases:
        with scope(2):
            model = exact_model()
            model.compile(optimizer=bandmf_optimizer(**optimizer_args), loss=LOSS)
        try:
            fit_bandmf(model, "fixed", epochs=epochs)
            messages.append(f"TRAINED | steps={model.privacy.steps}")
        except ValueError as error:
            messages.append(f"{error} | steps={model.privacy.steps}")
    return np.array(messages)


# -- main -----------------------------------------------------------------------


def mirrored(out):
    replicas = REPLICAS
    results = {}
    # R = 3 checks the parts R = 2 cannot (uneven shares, 1/3 scaling); the
    # mechanism-specific checks run once, with R = 2. The single-device
    # references (R = 1, seeded: the same numbers in every process) run once,
    # in the R = 2 process; the R = 3 and worker tests read them from there.
    names = list(EXACT_OPTIMIZERS) if replicas == 2 else ["dpsgd"]
    single = (1,) if replicas == 2 else ()
    for name in names:
        for r in (*single, replicas):
            with timed(f"exact {name} R={r}"):
                w, steps, eps, loss = train_exact(name, r)
            results[f"exact_{name}_{r}"] = w
            results[f"steps_{name}_{r}"] = steps
            results[f"epsilon_{name}_{r}"] = eps
            results[f"logs_{name}_{r}"] = loss
    with timed("noise"):
        if single:
            results["noise_1"] = global_noise(1)
        results["noise"] = global_noise(replicas)
        with patched("noise_scale", lambda: 1.0):
            results["noise_unscaled"] = global_noise(replicas)
    with timed("parts"):
        results["parts"] = replica_noise(replicas)
        results["parts_unseeded"] = replica_noise(replicas, seed=None)  # OS entropy
    if replicas == 2:
        with timed("adadp parts"):
            results["adadp_parts"] = adadp_replica_noise(replicas)
            with patched("noise_scale", lambda: 1.0):
                results["adadp_parts_unscaled"] = adadp_replica_noise(replicas)
        # negative controls: the decay added in full on every replica; AdaDP's
        # s read from one replica's part of the gradient
        with timed("controls"):
            with patched("replica_share", lambda: 1.0):
                results["exact_dpsgd_unshared_decay"] = train_exact("dpsgd", replicas)[0]
            with patched("sum_over_replicas", list):
                results["exact_adadp_local_moments"] = train_exact("adadp", replicas)[0]
        with timed("physical batches"):  # each replica's share in chunks of 5
            chunked = train_exact("dpsgd", replicas, physical_batch_size=5)
            results["exact_dpsgd_chunked_2"], _, _, results["logs_dpsgd_chunked_2"] = chunked
        with timed("user level"):
            for r in (1, replicas):
                results[f"exact_users_{r}"] = train_exact("dpsgd", r, users=True)[0]
        with timed("refusals"):
            for name, message in refusal_messages(replicas).items():
                results[f"refusal_{name}"] = message
        with timed("draws"):
            results["draws"] = unseeded_draws(replicas)
        with timed("bandmf"):
            for mode in ("fixed", "amplified"):
                for r in (1, replicas):
                    w, steps, eps = train_bandmf(mode, r)
                    results.update({f"bandmf_{mode}_{r}": w, f"bandmf_{mode}_steps_{r}": steps,
                                    f"bandmf_{mode}_epsilon_{r}": eps})
            with patched("replica_share", lambda: 1.0):  # negative control: w_t R times
                results["bandmf_fixed_unshared"] = train_bandmf("fixed", replicas)[0]
            folder = os.path.dirname(os.path.abspath(out))
            for r in (1, replicas):
                results[f"bandmf_saved_{r}"], results[f"bandmf_resumed_{r}"] = resumed_bandmf(
                    r, folder)
    if replicas == 3:
        # a fixed-order batch of 25 on 3 replicas: shares of 9, 8 and 8 rows,
        # the two padding rows (row 0 again) with mask 0
        with timed("bandmf uneven shares"):
            for r in (1, replicas):
                results[f"bandmf_uneven_{r}"] = train_bandmf("fixed", r, batch_size=25)[0]

            split = distribute.replica_shares

            def unmasked(indices, mask, num_replicas):  # negative control: padding counted
                shares, share_mask = split(indices, mask, num_replicas)
                return shares, tf.ones_like(share_mask)

            with patched("replica_shares", unmasked):
                results["bandmf_uneven_unmasked"] = train_bandmf(
                    "fixed", replicas, batch_size=25)[0]
    np.savez(out, **results)


def worker(out):
    task = STRATEGY.cluster_resolver.task_id
    results = {"task": task}
    with timed("exact"):
        w, steps, eps, loss = train_exact("dpsgd", 2)
    results.update(exact_dpsgd=w, steps=steps, epsilon=eps)
    with timed("source"):
        w, steps, eps, reads, shares = train_exact_source(2)
    results.update(source_dpsgd=w, source_steps=steps, source_epsilon=eps,
                   source_reads=reads, source_shares=shares)
    with timed("noise"):
        results["noise"] = global_noise(2)
        with patched("noise_scale", lambda: 1.0):
            results["noise_unscaled"] = global_noise(2)
    with timed("parts"):
        results["parts"] = replica_noise(2)
        results["parts_unseeded"] = replica_noise(2, seed=None)  # each worker's own entropy
    with timed("draws"):
        results["draws"] = unseeded_draws(2)
    with timed("keras paths"):
        results["keras_paths"] = keras_paths(2)
    with timed("seeds"):
        results["shared_seed"] = str(distribute.shared_sampling_seed(STRATEGY, 96))
        try:  # worker 1 holds one example more: both must refuse
            distribute.shared_sampling_seed(STRATEGY, 96 + task)
            results["mismatch"] = "accepted"
        except ValueError as error:
            results["mismatch"] = str(error)
    with timed("settings"):
        results["settings_refusals"] = mismatched_settings(task)
    with timed("bandmf"):
        for mode in ("fixed", "amplified"):
            results[f"bandmf_{mode}"], results[f"bandmf_{mode}_steps"], _ = train_bandmf(mode, 2)
        results["bandmf_noise"] = bandmf_global_noise(2)
        results["bandmf_noise_own_keys"] = bandmf_global_noise(2, shared_key=False)
        results["bandmf_mismatch"] = bandmf_mismatched_pipelines(task)
        results["bandmf_shared_state_prev"] = bandmf_shared_noise_state(
            os.path.dirname(os.path.abspath(out)))
        results["bandmf_noise_mismatch"] = bandmf_mismatched_noise(task)
    # The single-device references are the R = 2 process's (`mirrored`).
    np.savez(out, **results)


if __name__ == "__main__":
    {"mirrored": mirrored, "worker": worker}[MODE](sys.argv[3])
