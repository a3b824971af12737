"""Noise multipliers past dp_accounting's float range, capped at `MAX_NOISE`.

dp_accounting squares the noise multiplier in Python floats, which overflow
for sigma > ~1.3e154: epsilon then came out inf at 1e155 while 1e154 gave
0.0 (more noise, worse epsilon). A Gaussian with noise sigma' > sigma is the
Gaussian with sigma followed by independent N(0, sigma'^2 - sigma^2) noise, a
post-processing, so any bound at the smaller noise is a valid bound at the
larger one. Capping every Gaussian noise multiplier at 1e100 therefore keeps
epsilon a valid bound and never increasing with noise; at 1e100 the RDP of
2^53 steps at order 1024 is below 1e-180, so the capped epsilon is the float
value of the limit sigma -> inf (0.0 for the tight conversion).

Example:

>>> import dp_accounting
>>> cap_noise(dp_accounting.PoissonSampledDpEvent(
...     0.01, dp_accounting.GaussianDpEvent(1e300)))
PoissonSampledDpEvent(sampling_probability=0.01, event=GaussianDpEvent(noise_multiplier=1e+100))
"""

import attr
import dp_accounting

MAX_NOISE = 1e100


def cap_noise(event):
    """`event` with every Gaussian noise multiplier above `MAX_NOISE` set to it."""
    if isinstance(event, dp_accounting.GaussianDpEvent):
        if event.noise_multiplier > MAX_NOISE:
            return dp_accounting.GaussianDpEvent(MAX_NOISE)
        return event
    if isinstance(event, dp_accounting.ComposedDpEvent):
        events = [cap_noise(inner) for inner in event.events]
        if all(new is old for new, old in zip(events, event.events)):
            return event
        return dp_accounting.ComposedDpEvent(events)
    inner = getattr(event, "event", None)
    if isinstance(inner, dp_accounting.DpEvent) and attr.has(type(event)):
        capped = cap_noise(inner)
        return event if capped is inner else attr.evolve(event, event=capped)
    return event
