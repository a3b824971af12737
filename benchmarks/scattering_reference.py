"""kymatio 0.3.0 as the reference for tfdp.layers.Scattering2D.

kymatio is not a tfdp dependency (0.3.0, its last release, imports only with
scipy < 1.15), so this script has two halves run in two environments:

* `write` runs kymatio's numpy frontend on random and structured images and
  saves inputs and coefficients to an .npz file. It needs only numpy and
  kymatio, in its own virtual environment:

      python -m venv /work/kymatio-venv
      /work/kymatio-venv/bin/pip install kymatio==0.3.0 'scipy<1.15' numpy
      /work/kymatio-venv/bin/python benchmarks/scattering_reference.py write

  With no arguments it regenerates tests/layers/data/scattering_reference.npz,
  the small file tests/layers/test_scattering.py compares against (so CI
  needs no kymatio).
* `compare` (tfdp's environment) runs Scattering2D on the saved inputs and
  prints the relative L2 error per case, per image and per scattering order:

      python benchmarks/scattering_reference.py compare
      python benchmarks/scattering_reference.py write --random 64 --out /tmp/ref.npz
      python benchmarks/scattering_reference.py compare --reference /tmp/ref.npz

Cases: "fmnist28" (J=2, L=8 on 28x28x1: Tramer and Boneh's setting) and
"rect" (J=3, L=4 on 24x40x2, to exercise non-square images, other J and L and
several channels). Arrays in the file: `<case>_x` [B, H, W, C] float32 in
[0, 1], `<case>_s` [B, H/2^J, W/2^J, C*K] float32 (kymatio's [B, C, K, h, w]
output moved to channels last, channel c*K + k), `<case>_JL` = (J, L).
"""

import argparse
import gzip
import os

import numpy as np

DEFAULT_PATH = os.path.join(
    os.path.dirname(__file__), os.pardir, "tests", "layers", "data", "scattering_reference.npz"
)
FASHION_MNIST = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"
# structured: which of structured_images() a case uses (the file stays small).
CASES = {"fmnist28": dict(J=2, L=8, shape=(28, 28), channels=1, structured=[0, 2, 4]),
         "rect": dict(J=3, L=4, shape=(24, 40), channels=2, structured=[1, 3])}


def structured_images(height, width):
    """Edges, a disk, a checkerboard, an oriented grating and a thin stroke."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    cy, cx = (height - 1) / 2, (width - 1) / 2
    images = [
        (x > cx).astype(float),                                     # vertical step
        ((x - cx) ** 2 + (y - cy) ** 2 < (min(height, width) / 4) ** 2).astype(float),
        ((x // 4 + y // 4) % 2).astype(float),                      # checkerboard
        0.5 + 0.5 * np.sin(0.9 * (x * np.cos(0.6) + y * np.sin(0.6))),
        (np.abs(y - 0.7 * x - 2) < 1.5).astype(float),              # diagonal stroke
    ]
    return np.stack(images)


def fashion_mnist_images(count):
    """The first `count` Fashion-MNIST training images, in [0, 1]."""
    with gzip.open(FASHION_MNIST) as f:
        data = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28)
    return data[:count] / 255.0


def case_inputs(name, random_count, seed):
    """[B, H, W, C] inputs of a case: random uniform, structured, real images."""
    spec = CASES[name]
    height, width = spec["shape"]
    rng = np.random.RandomState(seed)
    structured = structured_images(height, width)[spec["structured"]]
    planes = [rng.rand(random_count, height, width), structured]
    if (height, width) == (28, 28):
        planes.append(fashion_mnist_images(1))
    planes = np.concatenate(planes)
    # Extra channels: the same planes in another order, so channels differ.
    channels = [np.roll(planes, c, axis=0) for c in range(spec["channels"])]
    return np.stack(channels, axis=-1).astype(np.float32)


def write(args):
    from kymatio.numpy import Scattering2D as KymatioScattering2D

    arrays = {}
    for name, spec in CASES.items():
        x = case_inputs(name, args.random, args.seed)
        scattering = KymatioScattering2D(J=spec["J"], shape=spec["shape"], L=spec["L"])
        s = scattering(x.transpose(0, 3, 1, 2).astype(np.float64))  # [B, C, K, h, w]
        b, c, k, h, w = s.shape
        arrays[f"{name}_x"] = x
        arrays[f"{name}_s"] = s.reshape(b, c * k, h, w).transpose(0, 2, 3, 1).astype(np.float32)
        arrays[f"{name}_JL"] = np.array([spec["J"], spec["L"]])
        print(f"{name}: x {x.shape} -> s {arrays[f'{name}_s'].shape}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    print(f"wrote {os.path.abspath(args.out)} ({os.path.getsize(args.out)} bytes)")


def order_slices(J, L, channels):
    """Output-channel indices of scattering orders 0, 1, 2 (all channels)."""
    k = 1 + J * L + L * L * J * (J - 1) // 2
    orders = {0: [0], 1: list(range(1, 1 + J * L)), 2: list(range(1 + J * L, k))}
    return {o: [c * k + i for c in range(channels) for i in idx] for o, idx in orders.items()}


def relative_error(actual, expected):
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def compare(args):
    from tfdp.layers import Scattering2D

    reference = np.load(args.reference)
    for name in CASES:
        x, expected = reference[f"{name}_x"], reference[f"{name}_s"]
        J, L = (int(v) for v in reference[f"{name}_JL"])
        actual = np.asarray(Scattering2D(J=J, L=L)(x))
        per_image = [relative_error(a, e) for a, e in zip(actual, expected)]
        per_order = {
            o: relative_error(actual[..., idx], expected[..., idx])
            for o, idx in order_slices(J, L, x.shape[-1]).items()
        }
        print(
            f"{name} (J={J}, L={L}, x {x.shape}): relative L2 error "
            f"{relative_error(actual, expected):.2e}; worst image {max(per_image):.2e}; "
            + "; ".join(f"order {o} {e:.2e}" for o, e in per_order.items())
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="run kymatio and save the reference (kymatio's venv)")
    w.add_argument("--out", default=DEFAULT_PATH)
    w.add_argument("--random", type=int, default=1, help="random images per case")
    w.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("compare", help="compare tfdp's Scattering2D with a saved reference")
    c.add_argument("--reference", default=DEFAULT_PATH)
    args = parser.parse_args()
    write(args) if args.command == "write" else compare(args)


if __name__ == "__main__":
    main()
