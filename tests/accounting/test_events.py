"""Tests for tfdp.accounting.events: the DP-SGD event and the JSON round trip."""

import json
import math

import attr
import dp_accounting
import pytest
from dp_accounting import dp_event

from tfdp.accounting import dpsgd_event, event_from_dict, event_to_dict

G = dp_accounting.GaussianDpEvent

# One instance of every event type dp_accounting defines (some twice, to
# cover default fields, union-typed fields and infinities).
ALL_EVENTS = [
    dp_event.NoOpDpEvent(),
    dp_event.NonPrivateDpEvent(),
    dp_event.UnsupportedDpEvent(),
    dp_event.RandomizedResponseDpEvent(noise_parameter=0.5, num_buckets=10),
    G(1.3),
    G(math.inf),
    dp_event.LaplaceDpEvent(2.0),
    dp_event.DiscreteLaplaceDpEvent(noise_parameter=0.5, sensitivity=1),
    dp_event.SelfComposedDpEvent(G(1.0), 5),
    dp_event.ComposedDpEvent([G(1.0), dp_event.SelfComposedDpEvent(G(2.0), 3)]),
    dp_event.ComposedDpEvent([]),
    dp_event.PoissonSampledDpEvent(0.01, G(1.1)),
    dp_event.SampledWithReplacementDpEvent(1000, 10, G(1.0)),
    dp_event.SampledWithoutReplacementDpEvent(1000, 10, G(1.0)),
    dp_event.SingleEpochTreeAggregationDpEvent(1.0, 5),
    dp_event.SingleEpochTreeAggregationDpEvent(1.0, [1, 2, 3]),
    dp_event.RepeatAndSelectDpEvent(G(1.0), 3.0, 1.0),
    dp_event.MixtureOfGaussiansDpEvent(1.0, [0.0, 1.0], [0.5, 0.5]),
    dp_event.ZCDpEvent(0.1, 0.01),
    dp_event.ZCDpEvent(0.1),
    dp_event.TruncatedSubsampledGaussianDpEvent(1000, 0.01, 20, 1.0),
    dp_event.PoissonSampledDpEvent(
        0.5, dp_event.ComposedDpEvent([dp_event.SelfComposedDpEvent(G(2.0), 4)])
    ),
]


def test_every_dp_accounting_event_type_is_covered():
    types = {
        cls
        for cls in vars(dp_event).values()
        if isinstance(cls, type) and issubclass(cls, dp_event.DpEvent) and cls is not dp_event.DpEvent
        and attr.has(cls)
    }
    assert types == {type(e) for e in ALL_EVENTS}


@pytest.mark.parametrize("event", ALL_EVENTS, ids=lambda e: type(e).__name__)
def test_round_trip_through_strict_json(event):
    text = json.dumps(event_to_dict(event), allow_nan=False)
    restored = event_from_dict(json.loads(text))
    assert restored == event
    assert type(restored) is type(event)


def test_dict_form_is_readable():
    assert event_to_dict(dpsgd_event(1.3, 0.0025)) == {
        "type": "PoissonSampledDpEvent",
        "sampling_probability": 0.0025,
        "event": {"type": "GaussianDpEvent", "noise_multiplier": 1.3},
    }
    assert event_to_dict(G(math.inf)) == {"type": "GaussianDpEvent", "noise_multiplier": "Infinity"}


def test_dpsgd_event():
    assert dpsgd_event(1.3, 0.0025) == dp_accounting.PoissonSampledDpEvent(0.0025, G(1.3))
    assert dpsgd_event(2, 1) == G(2.0)
    assert isinstance(dpsgd_event(2, 1.0), dp_accounting.GaussianDpEvent)
    event = dpsgd_event(1, 0.5)  # plain Python floats, whatever came in
    assert type(event.sampling_probability) is float
    assert type(event.event.noise_multiplier) is float


@pytest.mark.parametrize(
    "sigma, q, name, error",
    [
        (0.0, 0.1, "noise_multiplier", ValueError),
        (-1.0, 0.1, "noise_multiplier", ValueError),
        (math.nan, 0.1, "noise_multiplier", ValueError),
        (math.inf, 0.1, "noise_multiplier", ValueError),
        ("1.0", 0.1, "noise_multiplier", TypeError),
        (None, 0.1, "noise_multiplier", TypeError),
        (True, 0.1, "noise_multiplier", TypeError),
        (1.0, 0.0, "sampling_probability", ValueError),
        (1.0, 1.5, "sampling_probability", ValueError),
        (1.0, -0.1, "sampling_probability", ValueError),
        (1.0, math.nan, "sampling_probability", ValueError),
        (1.0, [0.1], "sampling_probability", TypeError),
    ],
)
def test_dpsgd_event_refuses_bad_arguments(sigma, q, name, error):
    with pytest.raises(error, match=f"`{name}`.*Received: {name}="):
        dpsgd_event(sigma, q)


def test_to_dict_refuses_non_events_and_foreign_types():
    with pytest.raises(TypeError, match="Expected `event` to be a dp_accounting DpEvent"):
        event_to_dict({"type": "GaussianDpEvent"})

    @attr.s(frozen=True)
    class HomeMadeEvent(dp_event.DpEvent):
        noise = attr.ib()

    with pytest.raises(ValueError, match="only dp_accounting's own event types"):
        event_to_dict(HomeMadeEvent(1.0))
    with pytest.raises(ValueError, match="only dp_accounting's own"):
        event_to_dict(dp_event.SelfComposedDpEvent(HomeMadeEvent(1.0), 2))
    with pytest.raises(ValueError, match="NaN"):
        event_to_dict(G(math.nan))


@pytest.mark.parametrize(
    "data, message",
    [
        ({"type": "FooDpEvent"}, "Unknown DpEvent type"),
        ({"type": "os.system"}, "Unknown DpEvent type"),
        ({"type": "DpEvent"}, "Unknown DpEvent type"),
        ({"noise_multiplier": 1.0}, "Unknown DpEvent type"),
        ("GaussianDpEvent", "Expected data to be a dict"),
        ({"type": "GaussianDpEvent"}, "Missing field 'noise_multiplier'"),
        ({"type": "GaussianDpEvent", "noise_multiplier": 1.0, "x": 1}, r"Unexpected field\(s\) \['x'\]"),
        ({"type": "GaussianDpEvent", "noise_multiplier": "abc"}, "noise_multiplier to be a number"),
        ({"type": "GaussianDpEvent", "noise_multiplier": True}, "noise_multiplier to be a number"),
        ({"type": "GaussianDpEvent", "noise_multiplier": None}, "noise_multiplier to be a number"),
        ({"type": "GaussianDpEvent", "noise_multiplier": "NaN"}, "noise_multiplier to be a number"),
        ({"type": "GaussianDpEvent", "noise_multiplier": -1.0}, r"noise_multiplier in \[0.0, inf\]"),
        (
            {"type": "SelfComposedDpEvent", "event": {"type": "NoOpDpEvent"}, "count": 2.5},
            "data.count to be an integer",
        ),
        (
            {"type": "SelfComposedDpEvent", "event": {"type": "NoOpDpEvent"}, "count": -3},
            r"data.count in \[0, inf\]",
        ),
        (
            {"type": "PoissonSampledDpEvent", "sampling_probability": 2.0, "event": {"type": "NoOpDpEvent"}},
            "sampling_probability in",
        ),
        (
            {"type": "PoissonSampledDpEvent", "sampling_probability": 0.1, "event": {"type": "Bad"}},
            "Unknown DpEvent type at data.event",
        ),
        ({"type": "ComposedDpEvent", "events": {"type": "NoOpDpEvent"}}, "data.events to be a list"),
        ({"type": "ComposedDpEvent", "events": [1.0]}, r"data.events\[0\] to be a dict"),
    ],
)
def test_from_dict_refuses_bad_data(data, message):
    with pytest.raises(ValueError, match=message):
        event_from_dict(data)
