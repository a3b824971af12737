"""One step that releases several Gaussian outputs of the same sampled batch.

A DP-SGD step with sparse embedding noise (`tfdp.optimizers.sparse_embeddings`)
releases, from one Poisson-sampled batch, the noisy gradient sum (noise
multiplier sigma_g on clip norm C) and each sparse table's noisy row counts
(noise multiplier sigma_c on the count's sensitivity). Its ledger event says
so: `PoissonSampledDpEvent(q, ComposedDpEvent([GaussianDpEvent(sigma_g),
GaussianDpEvent(sigma_c), ...]))`, the gradient's multiplier first.

The accountants read it as the one Gaussian it is. Each output, divided by
its noise's standard deviation, moves by at most 1 / sigma_i when a unit is
added (sensitivities C and sqrt(k), normalised); the concatenation has unit
isotropic noise and L2 sensitivity sqrt(sum sigma_i^-2). A Gaussian
mechanism's privacy loss depends on its L2 sensitivity over noise only, so
the k outputs together are exactly `GaussianDpEvent(z)` with
z = (sum sigma_i^-2)^(-1/2), and sampled once, `PoissonSampledDpEvent(q,
GaussianDpEvent(z))` (the sampling is shared: both draws see the same
batch; accounting two sampled events would charge the sampling twice).
`as_one_gaussian` makes that rewrite before any accountant runs.

Example:

>>> event = joint_step_event(0.01, [1.2, 4.0])
>>> as_one_gaussian(event).event.noise_multiplier == (1.2**-2 + 4.0**-2) ** -0.5
True
"""

import dp_accounting


def joint_step_event(sampling_probability, noise_multipliers):
    """The event of one sampled step releasing one Gaussian output per multiplier.

    Args:
        sampling_probability: q in (0, 1].
        noise_multipliers: the outputs' noise multipliers (each on its own
            normalised sensitivity), the gradient's first.

    Returns:
        `PoissonSampledDpEvent(q, ComposedDpEvent([GaussianDpEvent(s), ...]))`
        (q == 1 included: the statement then still names the split).
    """
    inner = dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(float(s)) for s in noise_multipliers])
    return dp_accounting.PoissonSampledDpEvent(float(sampling_probability), inner)


def joint_gaussians(event):
    """The multipliers of a composition of Gaussians only (else None)."""
    if not isinstance(event, dp_accounting.ComposedDpEvent) or not event.events:
        return None
    if not all(isinstance(e, dp_accounting.GaussianDpEvent) for e in event.events):
        return None
    return [e.noise_multiplier for e in event.events]


def as_one_gaussian(event):
    """`event` with each Poisson-sampled composition of Gaussians made one Gaussian.

    Only a composition directly under one Poisson sampling is rewritten (the
    outputs of one sampled batch); compositions elsewhere are left to the
    accountants, which compose them as they are.
    """
    if isinstance(event, dp_accounting.PoissonSampledDpEvent):
        multipliers = joint_gaussians(event.event)
        if multipliers is None:
            return event
        z = sum(s ** -2.0 for s in multipliers) ** -0.5
        return dp_accounting.PoissonSampledDpEvent(
            event.sampling_probability, dp_accounting.GaussianDpEvent(z))
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        inner = as_one_gaussian(event.event)
        return event if inner is event.event else dp_accounting.SelfComposedDpEvent(
            inner, event.count)
    if isinstance(event, dp_accounting.ComposedDpEvent):
        events = [as_one_gaussian(e) for e in event.events]
        if all(new is old for new, old in zip(events, event.events)):
            return event
        return dp_accounting.ComposedDpEvent(events)
    return event
