"""keras.io's transfer learning and fine-tuning, privately (offline by default).

docs/guides/pretrained-cnns.md as a script: a MobileNetV2 base, frozen, with
a new head trained with DP-SGD (step 1), then the top of the base unfrozen
with its BatchNormalization layers kept frozen (step 2), each step with a
target epsilon of its own; the ledger counts both. Offline the base has
random weights and the images are generated (class 1 brighter than class 0);
`--weights imagenet` loads the pretrained base (a download) for your own
images.

    python examples/dp_finetune_pretrained_cnn.py
    python examples/dp_finetune_pretrained_cnn.py --examples 2048 --image-size 96 --epochs 3
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdp  # noqa: E402


def generated_images(count, size, seed=0):
    """(images in [0, 255], labels): class 1's images are brighter."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, size=count)
    images = rng.uniform(0, 160, size=(count, size, size, 3)) + 80 * labels[:, None, None, None]
    return images.astype("float32"), labels


def build(size, weights):
    base = keras.applications.MobileNetV2(input_shape=(size, size, 3), alpha=0.35,
                                          weights=weights, include_top=False)
    base.trainable = False  # frozen: its BatchNormalization layers in inference mode
    inputs = keras.Input((size, size, 3))
    hidden = keras.layers.Rescaling(1 / 127.5, offset=-1)(inputs)
    hidden = base(hidden, training=False)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    return tfdp.DPModel(inputs, keras.layers.Dense(2)(hidden)), base


def compile_private(model, learning_rate, epsilon):
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(learning_rate, l2_norm_clip=1.0,
                                        target_epsilon=epsilon, target_delta=1e-5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2, help="epochs of each step")
    parser.add_argument("--weights", default=None, help="None (offline) or imagenet")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(args.seed)

    x, y = generated_images(args.examples, args.image_size, args.seed)
    split = int(0.8 * len(x))
    (x_train, y_train), (x_test, y_test) = (x[:split], y[:split]), (x[split:], y[split:])
    model, base = build(args.image_size, args.weights)

    compile_private(model, 0.5, epsilon=3.0)  # step 1: the head
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=0)
    print(model.per_example_path)
    print(f"step 1 (head): epsilon {model.privacy.epsilon(1e-5):.2f}")

    base.trainable = True  # step 2: the top 20 layers, BatchNormalization kept frozen
    for layer in base.layers[:-20]:
        layer.trainable = False
    for layer in base.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.trainable = False
    compile_private(model, 0.05, epsilon=5.0)  # 5 in all, 3 of them spent by step 1
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=0)
    epsilon = model.privacy.epsilon(1e-5)
    accuracy = model.evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    print(f"step 2 (top of the base): epsilon {epsilon:.2f} in all, test accuracy {accuracy:.3f}")
    print(model.privacy.statement(1e-5).splitlines()[0])
    return accuracy, epsilon


if __name__ == "__main__":
    main()
