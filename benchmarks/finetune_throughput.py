"""DP fine-tuning of KerasHub models: tfdp against plain Keras, same model.

Configs (random-init, the real KerasHub classes):
* bert_small: BertTextClassifier, 4 layers, hidden 256, 4 heads,
  intermediate 1024, vocabulary 30522, sequence 128;
* gpt2_tiny: GPT2CausalLM, 2 layers, hidden 128, 2 heads, intermediate 512,
  vocabulary 50257, sequence 128 (the tied output projection included);
* gemma_tiny: GemmaCausalLM, 2 layers, hidden 256, 4 query heads sharing 1
  key/value head of 64, intermediate 1024, vocabulary 32000, sequence 128
  (a small Gemma-style model: grouped-query attention, RMS norms, gated MLP).
BERT and GPT-2 run with LoRA rank 4 and Gemma with rank 8
(`backbone.enable_lora(rank)`: only the LoRA factors of the attention's
query/value projections and a classifier's head train), BERT and GPT-2 also
as full fine-tuning. tfdp runs twice: on the whole Poisson batch at once
("unsplit": the draw as it comes, not padded below batch 64) and with
`physical_batch_size` equal to the batch size ("k = batch": chunks past
the last drawn row are skipped and each chunk's logits are dropped with
it). For each config, one child
process builds the model once as `keras.Model` and twice as
`tfdp.DPModel` (the same layers and weights; plain Keras compiles with
the DP models' `jit_compile="auto"` choice, XLA on a GPU and not on a
CPU) and fits each for one epoch of `steps` steps, alternating for
`--rounds` rounds after a warm-up round; examples/s is the median over
rounds, timed inside `fit` from the end of the 3rd step to the end of the
last. Peak memory: separate child processes
(one per config and kind), the resident set's high-water mark during the
first `fit` (tracing included) above the resident set before it
(`/proc/self/clear_refs` resets the mark). "path" counts the per-example
handler each trainable layer took. Prints a Markdown table.

    python benchmarks/finetune_throughput.py               # ~30 minutes on 2 cores
    python benchmarks/finetune_throughput.py --only bert_small_lora --rounds 1
    python benchmarks/finetune_throughput.py --no-memory   # a GPU: host memory says little
"""

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# name: (batch size, steps per epoch)
CONFIGS = {
    "bert_small_lora": (32, 16),
    "gpt2_tiny_lora": (8, 16),
    "bert_small_full": (32, 16),
    "gpt2_tiny_full": (8, 16),
    "gemma_tiny_lora": (8, 16),
}
LORA_RANKS = {"bert": 4, "gpt2": 4, "gemma": 8}
LENGTH = 128
KINDS = ("plain", "dp", "dp_k")  # plain Keras; tfdp unsplit; tfdp with physical_batch_size = batch
DP_KINDS = KINDS[1:]


def build(name):
    """(keras inputs, outputs, x, y) for a config."""
    import keras_hub
    import numpy as np

    rng = np.random.default_rng(0)
    batch, steps = CONFIGS[name]
    n = batch * (steps + 1)
    mask = np.ones((n, LENGTH), bool)
    if name.startswith("bert"):
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=30522, num_layers=4, num_heads=4, hidden_dim=256,
            intermediate_dim=1024, max_sequence_length=LENGTH)
        task = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None)
        x = {"token_ids": rng.integers(1, 30522, (n, LENGTH)).astype("int32"),
             "segment_ids": np.zeros((n, LENGTH), "int32"), "padding_mask": mask}
        y = rng.integers(0, 2, n)
    elif name.startswith("gemma"):
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=32000, num_layers=2, num_query_heads=4, num_key_value_heads=1,
            hidden_dim=256, intermediate_dim=1024, head_dim=64)
        task = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
        tokens = rng.integers(1, 32000, (n, LENGTH + 1)).astype("int32")
        x = {"token_ids": tokens[:, :-1], "padding_mask": mask}
        y = tokens[:, 1:]
    else:
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=50257, num_layers=2, num_heads=2, hidden_dim=128,
            intermediate_dim=512, max_sequence_length=LENGTH)
        task = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        tokens = rng.integers(1, 50257, (n, LENGTH + 1)).astype("int32")
        x = {"token_ids": tokens[:, :-1], "padding_mask": mask}
        y = tokens[:, 1:]
    if name.endswith("lora"):
        backbone.enable_lora(LORA_RANKS[name.split("_")[0]])
    return task.inputs, task.outputs, x, y


def make_models(name):
    """(plain Keras model, DP model, DP model with physical batches, x, y):
    one set of layers and weights."""
    import functools

    import keras

    import tfdp

    keras.utils.set_random_seed(0)
    inputs, outputs, x, y = build(name)
    plain = keras.Model(inputs, outputs)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # The DP models' "auto" choice (XLA on a GPU, not on the CPU), like for like.
    plain.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss,
                  jit_compile=tfdp.models.jit.resolve_jit_compile("auto", model=plain))
    private = {}
    for kind in DP_KINDS:
        model = tfdp.DPModel(inputs, outputs)
        model.compile(optimizer=tfdp.optimizers.DPSGD(0.01, l2_norm_clip=1.0, noise_multiplier=1.0),
                      loss=loss)
        if kind == "dp_k":
            model.fit = functools.partial(model.fit, physical_batch_size=CONFIGS[name][0])
        private[kind] = model
    return {"plain": plain, **private}, x, y


def paths(model):
    """'handler x count' for the layers the batched plan runs."""
    from tfdp.per_example import plan_for

    plan = plan_for(model)
    if plan.path != "batched":
        return f"vectorized ({plan.reason})"
    counts = collections.Counter(type(h).__name__.replace("Rule", "") for _, h in plan.handlers)
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


def fit_once(model, x, y, name):
    import keras
    import numpy as np

    batch, steps = CONFIGS[name]
    times = {}
    first, last = 2, steps - 1

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, index, logs=None):
            if index in (first, last):
                float(np.asarray(logs["loss"]))  # waits for this step
                times[index] = time.perf_counter()

    model.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=steps, verbose=0,
              callbacks=[Clock()])
    return batch * (last - first) / (times[last] - times[first])


def speed_child(name, rounds):
    models, x, y = make_models(name)
    results = {kind: [] for kind in KINDS}
    for round_index in range(rounds + 1):
        for kind in KINDS:
            speed = fit_once(models[kind], x, y, name)
            if round_index:  # round 0 traces the steps
                results[kind].append(speed)
    private = models["dp"]
    trainable = sum(int(v.numpy().size) for v in private.trainable_variables)
    return {**{kind: statistics.median(v) for kind, v in results.items()},
            "path": paths(private), "trainable": trainable, "params": private.count_params()}


def _status_mb(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(name, kind):
    models, x, y = make_models(name)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset VmHWM to the current resident set
    before = _status_mb("VmRSS")
    fit_once(models[kind], x, y, name)
    return {"mb": _status_mb("VmHWM") - before}


def child(args):
    result = speed_child(args[0], int(args[1])) if args[1].isdigit() else memory_child(*args)
    print("RESULT " + json.dumps(result))


def run_child(*args):
    out = subprocess.run([sys.executable, __file__, "--child", *map(str, args)],
                         capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory children (host memory: not a GPU's)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child)
    print("| config | batch | trainable / params | plain ex/s | DP ex/s unsplit / k = batch | "
          "DP/plain unsplit / k = batch | peak MB plain | peak MB DP unsplit / k = batch | "
          "DP/plain mem unsplit / k = batch | per-example path |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.only:
        speed = run_child(name, args.rounds)
        ratio = {k: speed[k] / speed["plain"] for k in DP_KINDS}
        pair = lambda values, spec: " / ".join(f"{values[k]:{spec}}" for k in DP_KINDS)  # noqa: E731
        if args.no_memory:
            memory_cells = "- | - | -"
        else:
            memory = {kind: run_child(name, kind)["mb"] for kind in KINDS}
            mem_ratio = {k: memory[k] / max(memory["plain"], 1.0) for k in DP_KINDS}
            memory_cells = (f"{memory['plain']:.0f} | {pair(memory, '.0f')} | "
                            f"{pair(mem_ratio, '.2f')}")
        print(f"| {name} | {CONFIGS[name][0]} | {speed['trainable']:,} / {speed['params']:,} | "
              f"{speed['plain']:.1f} | {pair(speed, '.1f')} | {pair(ratio, '.2f')} | "
              f"{memory_cells} | {speed['path']} |", flush=True)


if __name__ == "__main__":
    main()
