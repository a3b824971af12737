"""dp_accounting events for tfdp's releases, and their JSON form.

Example:

>>> event = dpsgd_event(noise_multiplier=1.1, sampling_probability=0.01)
>>> event_from_dict(event_to_dict(event)) == event
True
"""

import math
import numbers

import attr
import dp_accounting

_EVENT_TYPES = {
    cls.__name__: cls
    for cls in vars(dp_accounting.dp_event).values()
    if isinstance(cls, type) and issubclass(cls, dp_accounting.DpEvent) and attr.has(cls)
}


def check_number(name, value, low=None, high=None, low_open=True, high_open=True):
    """Returns float(value) if it is a finite real in the given range.

    Raises TypeError for non-numbers and ValueError (naming the argument and
    the value, Keras style) for NaN, infinities and out-of-range values.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"Expected `{name}` to be a number. Received: {name}={value!r}")
    value = float(value)
    bad = not math.isfinite(value)
    if low is not None:
        bad = bad or (value <= low if low_open else value < low)
    if high is not None:
        bad = bad or (value >= high if high_open else value > high)
    if bad:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        span = f"in {left}{low if low is not None else '-inf'}, {high if high is not None else 'inf'}{right}"
        raise ValueError(f"Expected `{name}` to be a finite number {span}. Received: {name}={value}")
    return value


def check_count(name, value, minimum=0):
    """Returns int(value) if it is an integer >= minimum, else raises."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise TypeError(f"Expected `{name}` to be an integer. Received: {name}={value!r}")
    if value < minimum:
        raise ValueError(f"Expected `{name}` >= {minimum}. Received: {name}={value}")
    return int(value)


def dpsgd_event(noise_multiplier, sampling_probability):
    """One DP-SGD step: a Poisson-sampled Gaussian release.

    Args:
        noise_multiplier: sigma > 0 (noise std over sensitivity).
        sampling_probability: q in (0, 1]; q = 1 means the full dataset.

    Returns:
        `PoissonSampledDpEvent(q, GaussianDpEvent(sigma))`, or the Gaussian
        event alone when q == 1.
    """
    sigma = check_number("noise_multiplier", noise_multiplier, low=0.0)
    q = check_number("sampling_probability", sampling_probability, low=0.0, high=1.0, high_open=False)
    gaussian = dp_accounting.GaussianDpEvent(sigma)
    if q == 1.0:
        return gaussian
    return dp_accounting.PoissonSampledDpEvent(q, gaussian)


def _encode(value):
    if isinstance(value, dp_accounting.DpEvent):
        return event_to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if hasattr(value, "name") and hasattr(value, "value"):  # enums
        return {"enum": type(value).__name__, "name": value.name}
    return value


def event_to_dict(event):
    """A JSON-safe dict describing `event` (any dp_accounting DpEvent)."""
    name = type(event).__name__
    if name not in _EVENT_TYPES:
        raise TypeError(f"Expected a dp_accounting DpEvent. Received: event={event!r}")
    fields = {f.name: _encode(getattr(event, f.name)) for f in attr.fields(type(event))}
    return {"type": name, **fields}


def _decode(value):
    if isinstance(value, dict) and "type" in value:
        return event_from_dict(value)
    if isinstance(value, dict) and "enum" in value:
        enum = getattr(dp_accounting, value["enum"], None)
        if enum is None:
            raise ValueError(f"Unknown enum in a privacy ledger: {value['enum']!r}")
        return enum[value["name"]]
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def event_from_dict(data):
    """Inverse of `event_to_dict`; refuses unknown event types."""
    if not isinstance(data, dict) or data.get("type") not in _EVENT_TYPES:
        raise ValueError(f"Not a known dp_accounting event description: {data!r}")
    fields = {k: _decode(v) for k, v in data.items() if k != "type"}
    return _EVENT_TYPES[data["type"]](**fields)
