"""Private LoRA fine-tuning of a KerasHub text classifier (BERT).

With a preset whose weights are available (downloaded from Kaggle on first
use, or already in the KerasHub cache) it fine-tunes the pretrained BERT on
SST-2 (tensorflow-datasets `glue/sst2`):

    pip install 'tfdp[hub,examples]'
    python examples/dp_finetune_keras_hub.py --preset bert_tiny_en_uncased --epochs 3

Without `--preset` (and where nothing can be downloaded) it builds a
random-init BERT of the same shape from its config and fine-tunes it on a
generated task (label 1 when a marker token occurs), so the whole path runs
offline:

    python examples/dp_finetune_keras_hub.py --examples 2000 --epochs 3

Either way only the LoRA factors of the attention projections and the
classification head train (`backbone.enable_lora(rank)` freezes the rest), the
model is wrapped with one line, `tfdp.DPModel(classifier.inputs,
classifier.outputs)`, and the script prints test accuracy and epsilon (each
example is one text; its per-example gradients take the batched path).
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import keras_hub
import numpy as np

import tfdp

MARKER = 7


def generated_texts(n, sequence_length, vocabulary_size, seed):
    """Token inputs of a toy task: label 1 iff token MARKER occurs."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(4, sequence_length + 1, n)
    mask = np.arange(sequence_length)[None] < lengths[:, None]
    tokens = rng.integers(MARKER + 1, vocabulary_size, (n, sequence_length))
    labels = rng.integers(0, 2, n)
    where = (rng.random(n) * (lengths - 1)).astype(int) + 1
    tokens[labels == 1, where[labels == 1]] = MARKER
    x = {"token_ids": (tokens * mask).astype("int32"),
         "segment_ids": np.zeros_like(tokens, dtype="int32"),
         "padding_mask": mask}
    return x, labels


def random_init_classifier(sequence_length, hidden_dim=128, vocabulary_size=1000):
    """A BERT-tiny-shaped classifier (2 layers, hidden 128) with random weights."""
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=vocabulary_size, num_layers=2, num_heads=2, hidden_dim=hidden_dim,
        intermediate_dim=4 * hidden_dim, max_sequence_length=sequence_length)
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None)


def sst2(classifier, sequence_length, n):
    """SST-2 train and validation splits tokenized by the preset's preprocessor."""
    import tensorflow_datasets as tfds

    preprocessor = classifier.preprocessor
    preprocessor.sequence_length = sequence_length

    def split(name):
        data = tfds.load("glue/sst2", split=f"{name}[:{n}]", batch_size=-1)
        texts = [t.decode() for t in data["sentence"].numpy()]
        x = preprocessor(np.array(texts))
        return {k: np.asarray(v) for k, v in x.items()}, data["label"].numpy()

    return split("train"), split("validation")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default=None, help="KerasHub BERT preset (needs its weights)")
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--sequence-length", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden-dim", type=int, default=128, help="random-init config only")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--l2-norm-clip", type=float, default=1.0)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(args.seed)

    if args.preset:
        classifier = keras_hub.models.BertTextClassifier.from_preset(args.preset, num_classes=2)
        (x, y), (x_test, y_test) = sst2(classifier, args.sequence_length, args.examples)
    else:
        classifier = random_init_classifier(args.sequence_length, args.hidden_dim)
        x, y = generated_texts(args.examples, args.sequence_length, 1000, args.seed)
        x_test, y_test = generated_texts(max(args.examples // 4, 16), args.sequence_length, 1000,
                                         args.seed + 1)
    classifier.backbone.enable_lora(args.rank)
    model = tfdp.DPModel(classifier.inputs, classifier.outputs)
    model.compile(
        optimizer=tfdp.optimizers.DPSGD(l2_norm_clip=args.l2_norm_clip,
                                        noise_multiplier=args.noise_multiplier,
                                        learning_rate=args.learning_rate, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["sparse_categorical_accuracy"],
    )
    print(model.per_example_path)
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    print(f"trainable parameters: {trainable} of {model.count_params()}")
    # Chunks of batch_size rows: memory follows the drawn batch, not its
    # padded fixed shape (README, "Memory at small batches").
    model.fit(x, y, batch_size=args.batch_size, physical_batch_size=args.batch_size,
              epochs=args.epochs, verbose=2)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    delta = min(1e-5, 1.0 / len(y))  # fit's default: the epsilon in its logs
    print(f"test accuracy: {accuracy:.4f}")
    print(f"epsilon: {model.privacy.epsilon(delta):.3f} at delta {delta:.2g}")
    return accuracy, model.privacy.epsilon(delta)


if __name__ == "__main__":
    main()
