"""DP-SGD (and DP-BandMF) throughput against the number of tf.distribute replicas.

Trains the 4-layer tanh CNN of MECHANISMS.md section 6 (synthetic 28x28
data, Poisson batches of expected global size `--batch-size`) with
`tfdp.optimizers.DPSGD`, and with `--optimizers dpsgd bandmf` also with
`tfdp.optimizers.DPBandMF` (`--bands` b, amplified by cyclic Poisson
sampling at the same expected batch: each replica keeps its copy of the
b - 1 noise vectors and rewrites it each step), and reports examples per
second, one configuration per fresh process (logical devices must be set
before TensorFlow starts):

- no strategy (the single-device baseline);
- MirroredStrategy over R logical CPU devices of this machine, R in
  `--replicas` (the logical devices share the machine's cores);
- MultiWorkerMirroredStrategy with `--workers` local worker processes on
  127.0.0.1 (one CPU device each), unless `--workers 0`.

The global expected batch size is the same in every row, so the privacy
(epsilon) of a step is the same; only the work per replica shrinks.
Prints one Markdown table.

    python benchmarks/distribute_scaling.py                    # ~2 minutes on 2 cores
    python benchmarks/distribute_scaling.py --repeats 3        # median of 3 rounds
    python benchmarks/distribute_scaling.py --replicas 1,2,4,8 --batch-size 1024
    python benchmarks/distribute_scaling.py --optimizers dpsgd bandmf --bands 4 --repeats 3
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def measure(config, args):
    """Examples/s over `args.epochs - 1` timed epochs (the first warms up)."""
    import tensorflow as tf

    kind, replicas = config["kind"], config["replicas"]
    if kind == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * replicas
        )
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(replicas)])
    elif kind == "multi_worker":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = None

    import absl.logging
    import keras
    import numpy as np

    import tfdp
    from tfdp import recipes

    absl.logging.set_verbosity("error")
    num = args.batch_size * args.steps
    rng = np.random.default_rng(0)
    x = rng.random((num, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, num)

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.start)

    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        keras.utils.set_random_seed(0)
        model = tfdp.DPSequential(recipes.tanh_cnn())
        if config["optimizer"] == "bandmf":
            optimizer = tfdp.optimizers.DPBandMF(
                keras.optimizers.SGD(0.5), l2_norm_clip=1.0, noise_multiplier=1.0,
                bands=args.bands)
        else:
            optimizer = tfdp.optimizers.DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.0)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    timer = Timer()
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, verbose=0,
              callbacks=[timer])
    timed = timer.seconds[1:]
    return {
        **config,
        "examples_per_s": args.batch_size * args.steps / float(np.median(timed)),
        "epsilon": model.privacy.epsilon(1e-5),
        "steps": model.privacy.steps,
    }


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _child(args, config):
    result = measure(config, args)
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")


def _spawn(args, config, tf_config=None):
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    command = [
        sys.executable, os.path.abspath(__file__), "--child", json.dumps(config),
        "--batch-size", str(args.batch_size), "--steps", str(args.steps),
        "--epochs", str(args.epochs), "--bands", str(args.bands),
    ]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _collect(procs, timeout):
    results = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise SystemExit(f"a configuration ran over {timeout} s")
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"a configuration failed:\n{out[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", default="1,2,4",
                        help="comma-separated MirroredStrategy replica counts")
    parser.add_argument("--workers", type=int, default=2,
                        help="local MultiWorkerMirroredStrategy workers (0: skip)")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch")
    parser.add_argument("--epochs", type=int, default=3, help="the first is warm-up")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over all setups (interleaved; the median is shown)")
    parser.add_argument("--optimizers", nargs="+", choices=("dpsgd", "bandmf"),
                        default=["dpsgd"], help="each is measured in every setup")
    parser.add_argument("--bands", type=int, default=4, help="DP-BandMF's bands")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args, json.loads(args.child))

    setups = [{"kind": "single", "replicas": 1}] + [
        {"kind": "mirrored", "replicas": int(r)} for r in args.replicas.split(",")
    ]
    if args.workers:
        setups.append({"kind": "multi_worker", "replicas": args.workers})
    configs = [{**setup, "optimizer": name} for name in args.optimizers for setup in setups]
    # Interleaved rounds, so a change in the machine's load hits every setup.
    runs = {i: [] for i in range(len(configs))}
    for _ in range(args.repeats):
        for i, config in enumerate(configs):  # one at a time: each may use every core
            if config["kind"] != "multi_worker":
                runs[i] += _collect([_spawn(args, config)], args.timeout)
                continue
            ports = _free_ports(args.workers)
            cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
            procs = [
                _spawn(args, config, {"cluster": cluster, "task": {"type": "worker", "index": w}})
                for w in range(args.workers)
            ]
            runs[i] += _collect(procs, args.timeout)[:1]  # all workers time the same steps

    import statistics

    speeds = {i: [r["examples_per_s"] for r in rows] for i, rows in runs.items()}
    optimizers = {"dpsgd": "DP-SGD", "bandmf": f"DP-BandMF ({args.bands} bands, amplified)"}
    print(f"{' and '.join(optimizers[name] for name in args.optimizers)}, tanh CNN, expected "
          f"global batch {args.batch_size}, {os.cpu_count()} CPU cores, {args.steps} steps per "
          f"timed epoch, median of {args.repeats} interleaved run(s)\n")
    print("| optimizer | setup | replicas | examples/s (min-max) | vs no strategy "
          "| epsilon (delta 1e-5) |")
    print("|---|---|---|---|---|---|")
    names = {"single": "no strategy", "mirrored": "MirroredStrategy (logical CPUs)",
             "multi_worker": "MultiWorkerMirroredStrategy (loopback workers)"}
    for i, config in enumerate(configs):
        median = statistics.median(speeds[i])
        base = statistics.median(speeds[configs.index(
            {"kind": "single", "replicas": 1, "optimizer": config["optimizer"]})])
        print(f"| {optimizers[config['optimizer']]} | {names[config['kind']]} "
              f"| {config['replicas']} | {median:.0f} ({min(speeds[i]):.0f}-{max(speeds[i]):.0f}) "
              f"| {median / base:.2f}x | {runs[i][0]['epsilon']:.3f} |")


if __name__ == "__main__":
    main()
