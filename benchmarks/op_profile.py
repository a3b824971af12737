"""Where a compiled DP step's time goes, op by op, against plain Keras's step.

For a model of `benchmarks/throughput.py`'s zoo (its batch size, one fixed
batch, no input pipeline, no XLA), runs the DP `train_step` and Keras's own
`train_step` of `benchmarks/step_breakdown.py` as `tf.function`s under
TensorFlow's profiler and prints the time of each op type (ms a step,
summed over the step's ops of that type: `--by-name` prints single ops
instead), and how many ops each step's graph holds (its functions and
branches included, run or not). The profiler adds
its own cost to every op: read the rows against each other, and whole-step
times from `benchmarks/step_breakdown.py` or `benchmarks/long_fit.py`.

    python benchmarks/op_profile.py --model mlp_2048
    python benchmarks/op_profile.py --model mlp --by-name --top 40
"""

import argparse
import collections
import glob
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402
from step_breakdown import stages  # noqa: E402
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402
from throughput import ZOO  # noqa: E402

# Graph attributes that name a function the op runs (calls, branches, loops).
_FUNCTION_ATTRS = ("f", "then_branch", "else_branch", "body", "cond")


def graph_ops(graph, seen=None):
    """Counter of op types in `graph` and every function its ops name."""
    seen = set() if seen is None else seen
    counts = collections.Counter()
    for op in graph.get_operations():
        counts[op.type] += 1
        for attr in _FUNCTION_ATTRS:
            try:
                function_name = op.get_attr(attr).name
            except (ValueError, AttributeError):
                continue
            if function_name in seen:
                continue
            seen.add(function_name)
            function = graph._get_function(function_name)
            if function is not None and hasattr(function, "graph"):
                counts.update(graph_ops(function.graph, seen))
    return counts


def profiled(step, repeats, by_name):
    """(ms a step under the profiler, Counter of ms a step by op type or name)."""
    for _ in range(3):
        step()
    with tempfile.TemporaryDirectory() as logdir:
        start = time.perf_counter()
        tf.profiler.experimental.start(logdir)
        for _ in range(repeats):
            result = step()
        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, result)
        tf.profiler.experimental.stop()
        wall = (time.perf_counter() - start) / repeats * 1e3
        space = xplane_pb2.XSpace()
        with open(glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)[0], "rb") as f:
            space.ParseFromString(f.read())
    totals = collections.Counter()
    for plane in space.planes:
        if "host:CPU" not in plane.name:
            continue
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                label = names.get(event.metadata_id, "")
                # "op name:OpType", the executor's op events (not its own
                # "ExecutorState::Process" or "EagerLocalExecute: ..." spans).
                if ":" in label and "::" not in label and not label.startswith("Eager"):
                    key = label if by_name else label.rsplit(":", 1)[-1]
                    totals[key] += event.duration_ps / 1e9 / repeats
    return wall, totals


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", nargs="+", choices=sorted(ZOO), default=["mlp"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--by-name", action="store_true")
    args = parser.parse_args()
    for name in args.model:
        steps = dict(stages(name))  # step_breakdown's steps, on one batch of the model
        for label in ("DP train_step", "Keras train_step"):
            step = tf.function(steps[label])
            ops = graph_ops(step.get_concrete_function().graph)
            wall, totals = profiled(step, args.repeats, args.by_name)
            print(f"\n{name}, {label}: {sum(ops.values())} graph ops, {wall:.2f} ms a step "
                  "under the profiler\n\n| op | ms a step |\n|---|---|")
            for op, ms in totals.most_common(args.top):
                print(f"| {op} | {ms:.2f} |")


if __name__ == "__main__":
    main()
