"""A plain-language statement of a differential privacy guarantee.

Example:

>>> print(privacy_statement(2.93, 1e-5, 14040).splitlines()[0])
This model was trained with (epsilon=2.93, delta=1e-05)-differential privacy at the record level, over 14040 private training steps.
"""


def privacy_statement(epsilon, delta, steps):
    """A few sentences a practitioner can put in a model card.

    Args:
        epsilon: the epsilon the ledger reports.
        delta: the delta it was computed at.
        steps: the number of private training steps.
    """
    return (
        f"This model was trained with (epsilon={epsilon:.3g}, delta={delta:.3g})-differential "
        f"privacy at the record level, over {steps} private training steps.\n"
        "Meaning: adding or removing any one training record changes the probability of "
        f"any outcome of training by at most a factor e^epsilon = {2.718281828 ** epsilon:.3g}, "
        f"except with probability at most delta.\n"
        "Covered: the trained weights and anything computed from them alone, and every "
        "release in the privacy ledger (noisy gradients, and the extra noisy statistics "
        "some mechanisms use).\n"
        "Not covered: hyperparameters tuned by looking at results on the private data, "
        "training-set loss and metrics shown in the logs, data-dependent preprocessing, and "
        "anything released outside tfdp. Records of one person counted as several records "
        "get a weaker, group-level guarantee."
    )
