"""dp_accounting events for tfdp's releases, and their JSON form.

Every private release tfdp makes is described by a `dp_accounting.DpEvent`;
the `PrivacyLedger` composes them. This module builds the DP-SGD event and
converts any dp_accounting event to a JSON-safe dict and back, so a ledger can
be saved with a model.

Example:

>>> import json
>>> event = dpsgd_event(noise_multiplier=1.1, sampling_probability=0.01)
>>> event
PoissonSampledDpEvent(sampling_probability=0.01, event=GaussianDpEvent(noise_multiplier=1.1))
>>> text = json.dumps(event_to_dict(event))
>>> event_from_dict(json.loads(text)) == event
True
"""

import math
import numbers
import typing

import attr
import dp_accounting
from dp_accounting import dp_event as _dp_event

from tfdp.accounting._validation import check_real, show

# Every concrete event type dp_accounting defines, by class name. Only these
# are (de)serialized: a JSON file never names an arbitrary class to import.
_EVENT_TYPES = {
    cls.__name__: cls
    for cls in vars(_dp_event).values()
    if isinstance(cls, type)
    and issubclass(cls, _dp_event.DpEvent)
    and cls is not _dp_event.DpEvent
    and attr.has(cls)
}

# Non-finite floats are not valid JSON; they are written as these strings.
_NON_FINITE = {"Infinity": math.inf, "-Infinity": -math.inf}


def dpsgd_event(noise_multiplier, sampling_probability):
    """The release of one DP-SGD step: a Poisson-sampled Gaussian mechanism.

    Each record joins the step's batch independently with probability
    `sampling_probability` (q); the sum of clipped gradients gets Gaussian
    noise of standard deviation `noise_multiplier` times the clip norm.

    Args:
        noise_multiplier: sigma, a finite number > 0.
        sampling_probability: q in (0, 1]; q = 1 means every step uses the
            whole dataset.

    Returns:
        `PoissonSampledDpEvent(q, GaussianDpEvent(sigma))`, or just
        `GaussianDpEvent(sigma)` when q == 1.

    Raises:
        TypeError: if an argument is not a number.
        ValueError: if sigma is not a finite number > 0 or q is not in (0, 1].

    Example:

    >>> dpsgd_event(1.3, 150 / 60000)
    PoissonSampledDpEvent(sampling_probability=0.0025, event=GaussianDpEvent(noise_multiplier=1.3))
    >>> dpsgd_event(2.0, 1.0)
    GaussianDpEvent(noise_multiplier=2.0)
    """
    sigma = check_real("noise_multiplier", noise_multiplier, low=0.0)
    q = check_real(
        "sampling_probability", sampling_probability, low=0.0, high=1.0, high_inclusive=True
    )
    gaussian = dp_accounting.GaussianDpEvent(sigma)
    if q == 1.0:
        return gaussian
    return dp_accounting.PoissonSampledDpEvent(q, gaussian)


# -- to dict -----------------------------------------------------------------


def _encode(value, where):
    if isinstance(value, _dp_event.DpEvent):
        return _event_to_dict(value, where)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        raise ValueError(f"Cannot serialize {where}={show(value)}: DpEvent fields are numbers or events.")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isnan(number):
            raise ValueError(f"Cannot serialize {where}=nan: a DpEvent parameter must not be NaN.")
        if math.isinf(number):
            return "Infinity" if number > 0 else "-Infinity"
        return number
    if isinstance(value, (list, tuple)) or hasattr(value, "tolist"):
        items = value.tolist() if hasattr(value, "tolist") else value
        if not isinstance(items, list):
            return _encode(items, where)
        return [_encode(item, f"{where}[{i}]") for i, item in enumerate(items)]
    raise ValueError(
        f"Cannot serialize {where}={show(value)} of type {type(value).__name__}."
    )


def _event_to_dict(event, where):
    cls = type(event)
    if _EVENT_TYPES.get(cls.__name__) is not cls:
        raise ValueError(
            f"Cannot serialize {where} of type {cls.__name__}: only dp_accounting's own "
            f"event types can be saved ({', '.join(sorted(_EVENT_TYPES))})."
        )
    data = {"type": cls.__name__}
    for field in attr.fields(cls):
        data[field.name] = _encode(getattr(event, field.name), f"{where}.{field.name}")
    return data


def event_to_dict(event):
    """A JSON-safe dict describing a dp_accounting event (nested events too).

    The dict has a "type" key (the event's class name) and one key per attrs
    field; nested events become nested dicts, lists become lists, and
    infinite numbers become the strings "Infinity" / "-Infinity".

    Args:
        event: any `dp_accounting.DpEvent` of a type dp_accounting defines.

    Returns:
        A dict that `json.dumps` accepts and `event_from_dict` inverts.

    Raises:
        TypeError: if `event` is not a DpEvent.
        ValueError: if it is a DpEvent type unknown to dp_accounting, or a
            parameter is NaN.

    Example:

    >>> event_to_dict(dpsgd_event(1.3, 0.0025))
    {'type': 'PoissonSampledDpEvent', 'sampling_probability': 0.0025, 'event': {'type': 'GaussianDpEvent', 'noise_multiplier': 1.3}}
    """
    if not isinstance(event, _dp_event.DpEvent):
        raise TypeError(
            f"Expected `event` to be a dp_accounting DpEvent. Received: event={show(event)} "
            f"(of type {type(event).__name__})"
        )
    return _event_to_dict(event, "event")


# -- from dict -----------------------------------------------------------------


def _decode_number(value, where, integer):
    if isinstance(value, str) and value in _NON_FINITE:
        value = _NON_FINITE[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"Expected {where} to be a number. Received: {show(value)}")
    if isinstance(value, float) and math.isnan(value):
        raise ValueError(f"Expected {where} to be a number, not NaN.")
    if integer:
        if isinstance(value, float):
            if not (math.isfinite(value) and value.is_integer()):
                raise ValueError(f"Expected {where} to be an integer. Received: {show(value)}")
            value = int(value)
    return value


def _decode(value, annotation, where):
    """Decodes one field value according to its attrs type annotation."""
    if annotation is _dp_event.DpEvent:
        return _event_from_dict(value, where)
    if annotation is int or annotation is float:
        return _decode_number(value, where, integer=annotation is int)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Union:
        if isinstance(value, list):
            annotation = next(a for a in args if typing.get_origin(a) in (list, typing.List))
        else:
            annotation = next(a for a in args if typing.get_origin(a) is None)
        return _decode(value, annotation, where)
    if origin is not None and args:  # List[...] / Sequence[...]
        if not isinstance(value, list):
            raise ValueError(f"Expected {where} to be a list. Received: {show(value)}")
        return [_decode(item, args[0], f"{where}[{i}]") for i, item in enumerate(value)]
    raise ValueError(f"Cannot decode {where}: unsupported field type {annotation!r}.")


# Parameters with a known valid range; a saved file outside it is corrupt.
_RANGES = {
    "noise_multiplier": (0.0, math.inf),
    "standard_deviation": (0.0, math.inf),
    "sampling_probability": (0.0, 1.0),
    "count": (0, math.inf),
    "source_dataset_size": (0, math.inf),
    "sample_size": (0, math.inf),
    "dataset_size": (0, math.inf),
    "truncated_batch_size": (0, math.inf),
    "num_buckets": (1, math.inf),
    "rho": (0.0, math.inf),
    "xi": (0.0, math.inf),
    "mean": (1.0, math.inf),  # RepeatAndSelectDpEvent: the expected number of trials
    "shape": (0.0, math.inf),  # and its law (inf: Poisson)
}


def _event_from_dict(data, where):
    if not isinstance(data, dict):
        raise ValueError(f"Expected {where} to be a dict describing a DpEvent. Received: {show(data)}")
    name = data.get("type")
    if not isinstance(name, str) or name not in _EVENT_TYPES:
        raise ValueError(
            f"Unknown DpEvent type at {where}: {show(name)}. Known types: "
            f"{', '.join(sorted(_EVENT_TYPES))}."
        )
    cls = _EVENT_TYPES[name]
    fields = {field.name: field for field in attr.fields(cls)}
    unexpected = sorted(set(data) - set(fields) - {"type"})
    if unexpected:
        raise ValueError(f"Unexpected field(s) {unexpected} for {name} at {where}.")
    values = {}
    for field_name, field in fields.items():
        if field_name not in data:
            if field.default is attr.NOTHING:
                raise ValueError(f"Missing field {field_name!r} for {name} at {where}.")
            continue
        field_where = f"{where}.{field_name}"
        value = _decode(data[field_name], field.type, field_where)
        if field_name in _RANGES:
            low, high = _RANGES[field_name]
            if not low <= value <= high:
                raise ValueError(f"Expected {field_where} in [{low}, {high}]. Received: {show(value)}")
        values[field_name] = value
    return cls(**values)


def event_from_dict(data):
    """The dp_accounting event described by `data` (the inverse of `event_to_dict`).

    Args:
        data: a dict as written by `event_to_dict` (for example read back
            with `json.loads`).

    Returns:
        The `dp_accounting.DpEvent`.

    Raises:
        ValueError: if the type is not one of dp_accounting's event types, a
            field is missing, unexpected, of the wrong kind, NaN, or out of its
            valid range. The message names where in `data` the problem is.

    Example:

    >>> event_from_dict({"type": "GaussianDpEvent", "noise_multiplier": 2.0})
    GaussianDpEvent(noise_multiplier=2.0)
    """
    return _event_from_dict(data, "data")
