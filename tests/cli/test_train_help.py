"""`tfdp train --help` explains every flag, with its default, and says in one
line what epsilon protects. The recipes' defaults it shows are the ones
`tfdp train` uses (tfdp.recipes, which `--help` does not import)."""

import argparse
import re

from tfdp import cli


def train_parser():
    commands = next(a for a in cli.build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    return commands.choices["train"]


def flag_help():
    """{flag: its help text, unwrapped} from `tfdp train --help`."""
    options = train_parser().format_help().split("options:\n")[1].split("\n\n")[0]
    entries = re.split(r"\n(?=  -)", options)
    return {entry.split()[0].rstrip(","): " ".join(entry.split()) for entry in entries}


def test_every_train_flag_has_help_and_a_default():
    described = flag_help()
    for action in train_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[-1]
        assert action.help, f"{flag} has no help"
        assert "(default: " in described[flag], f"{flag}'s help names no default: {described[flag]!r}"


def test_train_help_says_what_epsilon_protects():
    text = " ".join(train_parser().format_help().split())
    assert ("What epsilon protects: adding or removing any one training record changes the "
            "probability of any outcome of training by at most a factor e^epsilon") in text


def test_train_help_shows_the_recipes_defaults():
    from tfdp import recipes
    from tfdp.optimizers import adadp

    assert cli.RECIPES == recipes.DEFAULTS
    assert cli.SCATTERNET_RECIPES == recipes.SCATTERNET_DEFAULTS
    assert cli.ADADP_RECIPES == adadp.RECIPE_DEFAULTS
    described = flag_help()
    assert "(default: digits 30, fashion_mnist 40)" in described["--epochs"]
    assert ("(default: digits 64, fashion_mnist 2048; --features scatternet 8192, "
            "scatternet_cnn 2048; adadp: digits 64, fashion_mnist 2048)") in described["--batch-size"]
    assert "(default: 3)" in described["--epsilon"]
    assert "(default: 1e-05)" in described["--delta"]
