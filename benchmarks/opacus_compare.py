"""tfdp against PyTorch + Opacus on the throughput zoo, whole training loops.

For each zoo model of benchmarks/throughput.py the same architecture is built
in PyTorch and trained plain and with Opacus 1.6 (grad_sample_mode "hooks"
and "ghost"; DPLSTM / DPGRU / DPMultiheadAttention where Opacus needs its own
layers), on the same synthetic data, batch size and step count, with Poisson
sampling (Opacus's DPDataLoader) and SGD. The tfdp side is throughput.py's
whole `fit` call (plain Keras and tfdp). Every round runs one fresh tfdp
process and one fresh PyTorch process, one after the other, so both see the
same machine load; the table gives medians over rounds of examples/s over
the whole loop (data loading included) after a warm-up epoch in the same
process, and each library's DP/plain ratio. A mode Opacus refuses for a
model shows its error.

PyTorch and Opacus are never dependencies of tfdp: they run from their own
virtual environment, made once with

    python3 -m venv /work/opacus-venv
    /work/opacus-venv/bin/pip install torch==2.13.0 opacus==1.6.0

    python benchmarks/opacus_compare.py --rounds 3
    python benchmarks/opacus_compare.py --only mlp tanh_cnn_256 --rounds 2 --torch-threads 1
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TORCH_PYTHON = "/work/opacus-venv/bin/python"
MODES = ("torch", "hooks", "ghost")


def torch_model(name, nn):
    """The zoo model `name` as a torch.nn.Module (Opacus layers where needed)."""
    from opacus.layers import DPGRU, DPLSTM, DPMultiheadAttention

    class Pool(nn.Module):
        def forward(self, x):
            return x.mean(1)

    class Recurrent(nn.Module):
        def __init__(self, cell, bidirectional):
            super().__init__()
            self.embedding = nn.Embedding(20000, 128)
            units = 64 if cell is DPLSTM else 32
            self.rnn = cell(128, units, batch_first=True, bidirectional=bidirectional)
            self.out = nn.Linear(units * (2 if bidirectional else 1), 2)

        def forward(self, x):
            outputs, _ = self.rnn(self.embedding(x))
            return self.out(outputs[:, -1])

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = DPMultiheadAttention(128, 4, batch_first=True)
            self.norm1, self.norm2 = nn.LayerNorm(128), nn.LayerNorm(128)
            self.ffn = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))

        def forward(self, h):
            h = self.norm1(h + self.attention(h, h, h, need_weights=False)[0])
            return self.norm2(h + self.ffn(h))

    class Residual(nn.Module):
        def __init__(self, cin, filters, stride):
            super().__init__()
            self.skip = nn.Identity() if stride == 1 else nn.Conv2d(cin, filters, 1, stride)
            self.body = nn.Sequential(
                nn.Conv2d(cin, filters, 3, stride, padding=1), nn.GroupNorm(4, filters), nn.ReLU(),
                nn.Conv2d(filters, filters, 3, padding=1), nn.GroupNorm(4, filters))

        def forward(self, h):
            return nn.functional.relu(self.skip(h) + self.body(h))

    class Channels(nn.Module):  # [B, T, C] -> [B, C, T] for Conv1d
        def forward(self, x):
            return x.transpose(1, 2)

    if name.startswith("tanh_cnn"):  # Keras padding="same" for 8x8 stride 2 on 28: 3
        return nn.Sequential(
            nn.Conv2d(1, 16, 8, 2, padding=3), nn.Tanh(), nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, 2), nn.Tanh(), nn.MaxPool2d(2, 1), nn.Flatten(),
            nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, 10))
    if name.startswith("mlp"):
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(),
                             nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))
    if name == "text_pooling":
        return nn.Sequential(nn.Embedding(20000, 128), Pool(), nn.Linear(128, 2))
    if name == "embedding_lstm":
        return Recurrent(DPLSTM, False)
    if name == "embedding_bigru":
        return Recurrent(DPGRU, True)
    if name == "transformer":
        return nn.Sequential(nn.Embedding(5000, 128), Block(), Block(), Pool(), nn.Linear(128, 2))
    if name == "resnet_groupnorm":
        return nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), Residual(16, 16, 1), Residual(16, 32, 2),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    if name == "conv1d_series":
        return nn.Sequential(
            Channels(), nn.Conv1d(8, 32, 5), nn.ReLU(), nn.MaxPool1d(2), nn.Conv1d(32, 32, 5),
            nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(32, 2))
    raise ValueError(f"Unknown zoo model. Received: name={name!r}")


def torch_data(name, batch, steps):
    """Synthetic inputs and labels shaped as throughput.py's (channels first)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    n = batch * (steps + 1)
    shapes = {"tanh_cnn": ((1, 28, 28), None), "mlp": ((1, 28, 28), None),
              "text_pooling": ((128,), 20000), "embedding_lstm": ((100,), 20000),
              "embedding_bigru": ((100,), 20000), "transformer": ((128,), 5000),
              "resnet_groupnorm": ((3, 32, 32), None), "conv1d_series": ((128, 8), None)}
    shape, vocab = next(v for k, v in shapes.items() if name.startswith(k))
    if vocab:
        x = torch.from_numpy(rng.integers(1, vocab, (n,) + shape)).long()
    else:
        x = torch.from_numpy(rng.random((n,) + shape, dtype=np.float32))
    classes = 10 if name.startswith(("tanh_cnn", "mlp", "resnet")) else 2
    return x, torch.from_numpy(rng.integers(0, classes, n)).long()


def torch_child(name, batch, steps, rounds, threads=None):
    """{mode: examples/s or error} for plain torch and Opacus hooks / ghost."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    from opacus import PrivacyEngine
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Batches(TensorDataset):
        """Gathers a whole batch at once (not example by example)."""

        def __getitems__(self, indices):
            index = torch.as_tensor(indices)
            return tuple(t[index] for t in self.tensors)

    torch.manual_seed(0)
    x, y = torch_data(name, batch, steps)
    dataset = Batches(x, y)
    runs = {}
    for mode in MODES:
        model = torch_model(name, nn)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        criterion = nn.CrossEntropyLoss()
        loader = DataLoader(dataset, batch_size=batch, shuffle=True, collate_fn=lambda b: b)
        try:
            if mode != "torch":
                made = PrivacyEngine().make_private(
                    module=model, optimizer=optimizer, data_loader=loader, criterion=criterion,
                    noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode,
                    poisson_sampling=True)
                if len(made) == 4:  # ghost clipping wraps the criterion too
                    model, optimizer, criterion, loader = made
                else:
                    model, optimizer, loader = made
        except Exception as error:  # noqa: BLE001 - reported in the table
            runs[mode] = f"{type(error).__name__}: {str(error)[:60]}"
            continue
        runs[mode] = (model, optimizer, criterion, loader)

    def epoch(model, optimizer, criterion, loader):
        start = time.perf_counter()
        for step, (xb, yb) in enumerate(loader):
            if step == steps:
                break
            optimizer.zero_grad()
            criterion(model(xb), yb).backward()
            optimizer.step()
        return batch * steps / (time.perf_counter() - start)

    speeds = {mode: [] for mode, run in runs.items() if not isinstance(run, str)}
    for round_index in range(rounds + 1):
        for mode in speeds:
            try:
                value = epoch(*runs[mode])
            except Exception as error:  # noqa: BLE001
                runs[mode] = f"{type(error).__name__}: {str(error)[:60]}"
                speeds[mode] = None
                continue
            if round_index and speeds[mode] is not None:
                speeds[mode].append(value)
        speeds = {m: s for m, s in speeds.items() if s is not None}
    return {mode: statistics.median(speeds[mode]) if mode in speeds else runs[mode]
            for mode in MODES}


def tfdp_child(name, rounds):
    """{"plain": ex/s, "dp": ex/s} over whole fit calls (throughput.py)."""
    sys.path.insert(0, HERE)
    import throughput

    speeds = throughput.speed_child(name, rounds)["speeds"]
    return {kind: speeds[f"float32/{kind}"]["epoch"] for kind in ("plain", "dp")}


def run(python, *args):
    done = subprocess.run([python, __file__, "--child", json.dumps(args)],
                          capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:100]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    sys.path.insert(0, HERE)
    from throughput import ZOO

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(ZOO))
    parser.add_argument("--rounds", type=int, default=3, help="fresh-process rounds per model")
    parser.add_argument("--torch-python", default=DEFAULT_TORCH_PYTHON)
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads (default: PyTorch's own); on a machine "
                        "loaded by other processes 1 can be much faster than 2")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = json.loads(args.child)
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        print(json.dumps(torch_child(*rest) if kind == "torch" else tfdp_child(*rest)))
        return
    print("| model | batch | Keras ex/s | tfdp ex/s | tfdp DP/plain | torch ex/s | Opacus hooks "
          "| Opacus ghost | Opacus best DP/torch | tfdp DP / Opacus best |")
    print("|---" * 10 + "|")
    for name in args.only or ZOO:
        batch, steps = ZOO[name]
        tf_runs, torch_runs = [], []
        for _ in range(args.rounds):  # interleaved: one tfdp and one torch process a round
            tf_runs.append(run(sys.executable, "tfdp", name, 1))
            torch_runs.append(
                run(args.torch_python, "torch", name, batch, steps, 1, args.torch_threads))

        def median(runs, key):
            values = [r[key] for r in runs if isinstance(r.get(key), float)]
            if values:
                return statistics.median(values)
            return next((str(r.get(key, r.get("error"))) for r in runs), "?")

        keras_, dp = median(tf_runs, "plain"), median(tf_runs, "dp")
        torch_, hooks, ghost = (median(torch_runs, m) for m in MODES)
        opacus = [v for v in (hooks, ghost) if isinstance(v, float)]
        best = max(opacus) if opacus else None

        def show(value):
            return f"{value:,.0f}" if isinstance(value, float) else f"fails: {value}"

        ratio = (f"{dp / keras_:.2f}" if isinstance(dp, float) and isinstance(keras_, float)
                 else "")
        opacus_ratio = f"{best / torch_:.2f}" if best and isinstance(torch_, float) else ""
        lead = f"{dp / best:.2f}" if best and isinstance(dp, float) else ""
        print(f"| {name} | {batch} | {show(keras_)} | {show(dp)} | {ratio} | {show(torch_)} "
              f"| {show(hooks)} | {show(ghost)} | {opacus_ratio} | {lead} |", flush=True)


if __name__ == "__main__":
    main()
