"""The `tfdp` command: privacy questions and DP training from a shell.

    tfdp epsilon   --num-examples 60000 --batch-size 256 --noise-multiplier 1.1 --epochs 60
    tfdp calibrate --num-examples 60000 --batch-size 256 --epochs 60 --epsilon 3
    tfdp train     --dataset digits --epsilon 3
    tfdp validate  model.keras

`--help`, `epsilon` and `calibrate` import only the accountant (fast, no
TensorFlow); `train` and `validate` import TensorFlow, without its native
start-up lines.
"""

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
import tempfile
import time
import warnings

MECHANISMS = ("dpsgd", "sadpsgd", "dpis", "adadp",)
DATASETS = ("digits", "fashion_mnist")
DEBIAN_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # tfdp.data.datasets'


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _probability(text):
    value = _positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}")
    return value


def _momentum(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1), got {text!r}")
    return value


# tfdp.recipes' settings (DEFAULTS, SCATTERNET_DEFAULTS) and AdaDP's own
# (tfdp.optimizers.adadp.RECIPE_DEFAULTS), shown by `tfdp train --help`
# without importing Keras; tests/cli/test_train_help.py checks they agree.
RECIPES = {
    "digits": dict(epochs=30, batch_size=64, learning_rate=0.5, momentum=0.0,
                   l2_norm_clip=1.0, epsilon=3.0, delta=1e-5),
    "fashion_mnist": dict(epochs=40, batch_size=2048, learning_rate=4.0, momentum=0.9,
                          l2_norm_clip=0.1, epsilon=3.0, delta=1e-5),
}
SCATTERNET_RECIPES = {
    "scatternet": dict(epochs=40, batch_size=8192, learning_rate=16.0, momentum=0.9,
                       l2_norm_clip=0.1, epsilon=3.0, delta=1e-5),
    "scatternet_cnn": dict(epochs=40, batch_size=2048, learning_rate=4.0, momentum=0.9,
                           l2_norm_clip=0.1, epsilon=3.0, delta=1e-5),
}
ADADP_RECIPES = {
    "digits": dict(batch_size=64, learning_rate=0.02),
    "fashion_mnist": dict(batch_size=2048, learning_rate=0.002),
}

# One line of the privacy statement (tfdp.accounting.privacy_statement).
EPSILON_PROTECTS = (
    "What epsilon protects: adding or removing any one training record changes the "
    "probability of any outcome of training by at most a factor e^epsilon, except with "
    "probability delta (the 10% of the training split held out for validation is not "
    "trained on, and not covered)."
)


def _recipe_default(name):
    """"(default: digits 30, fashion_mnist 40; ...)": the recipes' value of
    setting `name`, one number where they all agree."""
    def listed(recipes):
        return ", ".join(f"{key} {values[name]:g}" for key, values in recipes.items()
                         if name in values)

    every = [r[name] for r in (*RECIPES.values(), *SCATTERNET_RECIPES.values())]
    if len(set(every)) == 1:
        return f"(default: {every[0]:g})"
    text = listed(RECIPES)
    if any(v[name] != RECIPES["fashion_mnist"][name] for v in SCATTERNET_RECIPES.values()):
        text += f"; --features {listed(SCATTERNET_RECIPES)}"
    if any(name in v for v in ADADP_RECIPES.values()):
        text += f"; adadp: {listed(ADADP_RECIPES)}"
    return f"(default: {text})"


def _add_dpsgd_settings(parser, noise=True):
    units = parser.add_mutually_exclusive_group(required=True)
    units.add_argument("--num-examples", type=_positive_int, help="training set size N")
    units.add_argument("--num-users", type=_positive_int,
                       help="number of people U, for user-level DP (fit(user_ids=...)): "
                            "--batch-size then counts people and epsilon protects a person")
    parser.add_argument("--batch-size", type=_positive_int, required=True, help="expected (Poisson) batch size")
    parser.add_argument("--epochs", type=_positive_float, required=True, help="epochs (steps = ceil(epochs * max(1, round(N / batch))), as fit runs them)")
    parser.add_argument("--delta", type=_probability, default=1e-5, help="target delta (default 1e-5)")
    parser.add_argument("--accountant", choices=("rdp", "pld"), default="rdp",
                        help="Renyi DP or privacy loss distributions (default: rdp)")
    if noise:
        parser.add_argument("--noise-multiplier", type=_positive_float, required=True,
                            help="noise standard deviation / clipping norm")


def build_parser():
    """The argument parser of the `tfdp` command."""
    parser = argparse.ArgumentParser(prog="tfdp", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    epsilon = commands.add_parser("epsilon", help="epsilon of DP-SGD settings (Poisson sampling)")
    _add_dpsgd_settings(epsilon)
    epsilon.add_argument("--conversion", choices=("tight", "classic"), default="tight",
                         help="RDP to (epsilon, delta): tight (default) or the papers' classic formula")

    calibrate = commands.add_parser("calibrate", help="noise multiplier for a target epsilon")
    _add_dpsgd_settings(calibrate, noise=False)
    calibrate.add_argument("--epsilon", type=_positive_float, required=True, help="target epsilon")

    train = commands.add_parser(
        "train", help="DP training on a built-in dataset",
        description="Trains the dataset's recipe model (tfdp.recipes) with differential "
                    "privacy, then prints test accuracy and epsilon as JSON.",
        epilog=EPSILON_PROTECTS,
    )
    train.add_argument("--mechanism", choices=MECHANISMS, default="dpsgd",
                       help="the DP optimizer: DP-SGD, SA-DPSGD, DPIS or AdaDP (default: dpsgd)")
    train.add_argument("--dataset", choices=DATASETS, default="digits",
                       help="scikit-learn's digits (offline) or Fashion-MNIST (default: digits)")
    train.add_argument("--data-dir", default=None,
                       help="folder holding Fashion-MNIST's four IDX files (default: "
                            f"{DEBIAN_FASHION_MNIST_DIR}, Debian's dataset-fashion-mnist, "
                            "then Keras's cache ~/.keras/datasets/fashion-mnist, then "
                            "tensorflow-datasets, which downloads it once)")
    train.add_argument("--features", choices=("none", "scatternet", "scatternet_cnn"), default="none",
                       help="fashion_mnist: train on ScatterNet features (+ linear or CNN) "
                            "(default: none, the pixels)")
    train.add_argument("--epochs", type=_positive_int, help="epochs to train " + _recipe_default("epochs"))
    train.add_argument("--batch-size", type=_positive_int,
                       help="expected (Poisson) batch size " + _recipe_default("batch_size"))
    train.add_argument("--learning-rate", type=_positive_float, help="step size " + _recipe_default("learning_rate"))
    train.add_argument("--momentum", type=_momentum,
                       help="SGD momentum, not AdaDP " + _recipe_default("momentum"))
    train.add_argument("--l2-norm-clip", type=_positive_float,
                       help="bound C on each example's gradient norm " + _recipe_default("l2_norm_clip"))
    budget = train.add_mutually_exclusive_group()
    budget.add_argument("--epsilon", type=_positive_float,
                        help="target epsilon: the noise is calibrated to spend at most this over the "
                             "epochs, and training stops there " + _recipe_default("epsilon"))
    budget.add_argument("--noise-multiplier", type=_positive_float,
                        help="noise standard deviation / C, instead of --epsilon "
                             "(default: calibrated from --epsilon)")
    train.add_argument("--delta", type=_probability,
                       help="target delta of the guarantee " + _recipe_default("delta"))
    train.add_argument("--seed", type=int, default=None,
                       help="reproducible noise (tests only: not private) (default: none)")
    train.add_argument("--output", default=None,
                       help="save the trained model, its privacy ledger included (.keras) "
                            "(default: not saved)")
    train.add_argument("--verbose", type=int, choices=(0, 1, 2), default=2,
                       help="0 silent, 1 progress bar, 2 a line per epoch (default: 2)")

    validate = commands.add_parser(
        "validate", help="what fit would refuse or run slowly in a saved model",
        description="Loads a saved model (.keras) and lists every layer, loss and setting "
                    "DP training would refuse or run on a slow path, with the reason and the "
                    "fix for each (tfdp.per_example.validate). Exit status 1 when fit would "
                    "refuse the model.")
    validate.add_argument("model", help="a saved model file (.keras)")
    return parser


def _epsilon(args):
    from tfdp import accounting

    value = accounting.compute_dpsgd_epsilon(
        args.num_examples, args.batch_size, args.noise_multiplier, args.epochs, args.delta,
        accountant=args.accountant, conversion=args.conversion, num_users=args.num_users,
    )
    return {"epsilon": value, "delta": args.delta}


def _calibrate(args):
    from tfdp import accounting

    sigma = accounting.calibrate_dpsgd(
        args.num_examples, args.batch_size, args.epochs, args.epsilon, args.delta,
        accountant=args.accountant, num_users=args.num_users,
    )
    achieved = accounting.compute_dpsgd_epsilon(
        args.num_examples, args.batch_size, sigma, args.epochs, args.delta,
        accountant=args.accountant, num_users=args.num_users,
    )
    return {"noise_multiplier": sigma, "epsilon": achieved, "delta": args.delta}


# TensorFlow's native start-up lines (absl C++ logging, CUDA probing on
# machines without a GPU): "cudart_stub.cc ... Could not find cuda drivers",
# "failed call to cuInit", "cpu_feature_guard.cc ...". They go straight to
# file descriptor 2, and TF_CPP_MIN_LOG_LEVEL does not silence all of them.
STARTUP_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called"
    r"|To enable the following instructions:"
    r"|[IW]\d{4} \S+\s+\d+ \S+\.cc:\d+\]"
    r"|E\d{4} \S+\s+\d+ cuda\w*\.cc:\d+\])"
)


@contextlib.contextmanager
def _startup_noise_hidden():
    """Captures file descriptor 2 meanwhile; then shows all but STARTUP_NOISE lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode("utf-8", "replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not STARTUP_NOISE.match(line))
            if kept:
                os.write(2, kept.encode("utf-8"))


def _import_tensorflow_quietly():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TF's own INFO and WARNING lines
    with _startup_noise_hidden():
        import tensorflow as tf

        tf.config.list_physical_devices()  # probes CUDA now, inside the capture


def _train(args):
    _import_tensorflow_quietly()
    from tfdp import training

    settings = {k: v for k, v in vars(args).items() if k not in ("command",)}
    return training.train(**settings)


def _validate(args):
    _import_tensorflow_quietly()
    import keras

    import tfdp

    if not os.path.exists(args.model):
        raise FileNotFoundError(f"No model file at {args.model!r}. Received: model={args.model!r}")
    model = keras.models.load_model(args.model, compile=True)
    return tfdp.per_example.validate(model).as_dict()


# dp_accounting warns once per RDP order when a huge noise's divergence rounds
# below zero, and answers 0 for that order: the right answer (the command
# prints it), so the warnings only bury it.
NEGATIVE_DIVERGENCE_WARNING = "Negative Renyi divergence"


class _NegativeDivergenceFilter(logging.Filter):
    def filter(self, record):
        return not str(record.msg).startswith(NEGATIVE_DIVERGENCE_WARNING)


@contextlib.contextmanager
def _large_delta_said(command):
    """Shows each `LargeDeltaWarning` (delta > 1/N) once, as one line
    "tfdp COMMAND: warning: ..." on stderr, instead of Python's two-line form."""
    from tfdp.accounting import LargeDeltaWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LargeDeltaWarning)
        try:
            yield
        finally:
            said = set()
            for warning in caught:
                if not issubclass(warning.category, LargeDeltaWarning):
                    warnings.showwarning(warning.message, warning.category, warning.filename,
                                         warning.lineno)
                elif str(warning.message) not in said:
                    said.add(str(warning.message))
                    sys.stderr.write(f"tfdp {command}: warning: {warning.message}\n")


@contextlib.contextmanager
def _negative_divergence_hidden():
    absl_logger = logging.getLogger("absl")
    hidden = _NegativeDivergenceFilter()
    absl_logger.addFilter(hidden)
    try:
        yield
    finally:
        absl_logger.removeFilter(hidden)


def _not_finite(result, args):
    """A sentence naming the result's numbers that JSON cannot carry (an
    infinite epsilon), or None."""
    names = [k for k, v in result.items() if isinstance(v, float) and not math.isfinite(v)]
    if not names:
        return None
    shown = ", ".join(f"{name}={result[name]}" for name in names)
    noise = getattr(args, "noise_multiplier", None)
    if "epsilon" in names and noise is not None:
        return (
            "epsilon is infinite for these settings: the noise is too small for any "
            f"finite epsilon at delta={result.get('delta', args.delta):g}. Received: "
            f"noise_multiplier={noise:g}"
        )
    return f"{', '.join(names)} not finite. Received: {shown}"


def main(argv=None):
    """Entry point of the `tfdp` command. Prints one JSON object.

    The output is strict JSON: a result that is not a finite number (an
    infinite epsilon) is an error line instead (`epsilon`, `calibrate`), or
    null in the JSON of a `train` run (followed by an error line, exit
    status 1, when it is the run's epsilon).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"epsilon": _epsilon, "calibrate": _calibrate, "train": _train,
                "validate": _validate}
    started = time.time()
    try:
        with _negative_divergence_hidden(), _large_delta_said(args.command):
            result = handlers[args.command](args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as error:
        parser.exit(2, f"tfdp {args.command}: error: {error}\n")
    if args.command == "train":
        result["seconds"] = round(time.time() - started, 1)
    not_finite = _not_finite(result, args)
    if not_finite and args.command != "train":
        parser.exit(2, f"tfdp {args.command}: error: {not_finite}\n")
    shown = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()}
    json.dump(shown, sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")
    if not math.isfinite(result.get("epsilon", 0.0)):  # trained and reported, without a guarantee
        parser.exit(1, f"tfdp {args.command}: error: {not_finite}\n")
    if result.get("output_error"):  # trained and reported, but not saved
        parser.exit(1, f"tfdp {args.command}: error: {result['output_error']}\n")
    if result.get("ok") is False:  # validate: fit would refuse the model
        parser.exit(1, f"tfdp {args.command}: fit would refuse this model\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
