"""Timing probes of what a DP `fit` adds around its step. NOT PRIVATE.

`benchmarks/fit_vs_step.py` shows that tfdp's fit adds more to its compiled
step than Keras's does. Each probe here changes one thing in the DP fit
(monkeypatched for the process: none of them may train a real model) and
times the steady step of a `--steps`-step fit (`long_fit.timed_fit`), all
variants alternating in one process over `--rounds` rounds:

- `no step hooks`: the per-step hooks of tfdp's fit callbacks (LedgerGuard's
  rollback check, ProvenanceWatch's state check, PrivacyBudget's limit and
  per-step epsilon) do nothing; `no <class> hooks`: that class's alone;
- `fixed length`: every Poisson batch cut or padded to the expected batch
  size (one batch length for every step);
- `gather in step`: the input pipeline draws the indices, and the step
  gathers the drawn rows from the whole data held as tensors.

Prints the median ms a step of each, and the median over rounds of the
ratio current / probe (above 1: the probe is faster).

    python benchmarks/fit_gap_probes.py
    python benchmarks/fit_gap_probes.py --only tanh_cnn_256 --rounds 7
"""

import os
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import long_fit  # noqa: E402
import throughput  # noqa: E402
from fit_vs_step import fit_arguments  # noqa: E402

MODELS = ("mlp", "conv1d_series", "tanh_cnn_256")
HOOKS = ("on_train_batch_begin", "on_train_batch_end")


def hook_classes():
    """The callback classes of tfdp's fit with per-step hooks."""
    from tfdp import callbacks
    from tfdp.models import restore
    from tfdp.preprocessing import provenance

    return (restore.LedgerGuard, provenance.ProvenanceWatch, callbacks.PrivacyBudget)


class Probes:
    """Switches the DP fit between the current code and one probe at a time."""

    def __init__(self, batch, x, y):
        import tensorflow as tf

        from tfdp.optimizers import dp_optimizer

        self.batch, self.active = batch, "current"
        self.data = (tf.constant(x), tf.constant(y))
        self._hooks = {(cls, name): cls.__dict__[name]
                       for cls in hook_classes() for name in HOOKS if name in cls.__dict__}
        self._make_training_data = dp_optimizer.DPOptimizer.make_training_data
        probes = self

        def make_training_data(optimizer, *args, **kwargs):
            dataset, steps = probes._make_training_data(optimizer, *args, **kwargs)
            if probes.active == "fixed length":
                dataset = dataset.map(probes._fixed_length)
            return dataset, steps

        dp_optimizer.DPOptimizer.make_training_data = make_training_data

    def names(self):
        return (["current", "no step hooks"]
                + [f"no {cls.__name__} hooks" for cls in hook_classes()]
                + ["fixed length"])

    def use(self, name):
        self.active = name
        for (cls, hook), function in self._hooks.items():
            off = name == "no step hooks" or name == f"no {cls.__name__} hooks"
            setattr(cls, hook, (lambda self, batch, logs=None: None) if off else function)

    def _fixed_length(self, arrays, info):
        import tensorflow as tf

        def fixed(tensor):
            tensor = tensor[:self.batch]
            padding = [[0, self.batch - tf.shape(tensor)[0]]] + [[0, 0]] * (tensor.shape.rank - 1)
            return tf.ensure_shape(tf.pad(tensor, padding), [self.batch] + tensor.shape[1:])

        return tf.nest.map_structure(fixed, arrays), dict(info, mask=fixed(info["mask"]))


def gathering_model(name, data):
    """A second DP model of the zoo's `name` whose step gathers its rows
    from `data` at indices the pipeline passes as x and y."""
    import keras
    import tensorflow as tf

    from tfdp.models.dp_model import DPModel

    class GatherInStep(DPModel):
        train_step_is_private = True  # it hands super() the records' own rows

        def train_step(self, batch):
            (indices, _), info = batch
            rows = tuple(tf.gather(t, indices) for t in data)
            return super().train_step((rows, info))

    inputs, outputs, _, _ = throughput.build(name)
    model = GatherInStep(inputs, outputs)
    model.compile(optimizer=throughput.private_optimizer(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def measure(name, steps, rounds):
    """{probe: (median ms a step, median ratio current / probe)}."""
    import tensorflow as tf

    batch = throughput.ZOO[name][0]
    throughput.ZOO[name] = (batch, steps)  # build() sizes the data: steps + 1 batches
    _, private, x, y = throughput.make_models(name)
    probes = Probes(batch, x, y)
    gathering = gathering_model(name, probes.data)
    models = {probe: private for probe in probes.names()}
    models["gather in step"] = gathering

    # The pipeline passes the drawn indices on as x and y: keep them.
    from tfdp.data import poisson

    gather_original = poisson.gathered_batches

    def pass_indices(pairs, tensors):
        if probes.active != "gather in step":
            return gather_original(pairs, tensors)
        return pairs.map(lambda indices, mask: (tf.nest.map_structure(
            lambda _: indices, tensors), mask))

    poisson.gathered_batches = pass_indices
    times = {probe: [] for probe in models}
    for round_index in range(rounds + 1):  # round 0 traces every variant
        for probe, model in models.items():
            probes.use(probe)
            if round_index == 0:
                model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=2, verbose=0)
            else:
                times[probe].append(1e3 * long_fit.timed_fit(model, x, y, batch, steps)[1])
    probes.use("current")
    poisson.gathered_batches = gather_original
    current = times["current"]
    return {probe: (statistics.median(values),
                    statistics.median(a / b for a, b in zip(current, values)))
            for probe, values in times.items()}


def main():
    args = fit_arguments(__doc__, MODELS)
    print(f"DP fit, steady ms a step (current / probe: median of per-round ratios), "
          f"{args.rounds} alternating rounds of {args.steps}-step fits. NOT PRIVATE probes.")
    print()
    print("| model | probe | ms a step | current / probe |")
    print("|---|---|---|---|")
    for name in args.only:
        for probe, (ms, ratio) in measure(name, args.steps, args.rounds).items():
            print(f"| {name} | {probe} | {ms:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
