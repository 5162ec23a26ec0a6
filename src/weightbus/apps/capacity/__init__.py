"""`weightbus plan`: the bytes per rank and the predicted time of a push, for a model given by
its config alone, on a cluster given by its layout and bandwidths (docs/scale.md)."""

from weightbus.apps.capacity.forecast import Forecast, Scenario, forecast
from weightbus.apps.capacity.profiles import PROFILES, hardware
from weightbus.apps.capacity.shapes import ModelTensors, model_tensors
from weightbus.apps.capacity.sharding import EngineLayout
from weightbus.apps.capacity.timing import Hardware, Timing
from weightbus.apps.capacity.traffic import Traffic

__all__ = [
    "PROFILES",
    "EngineLayout",
    "Forecast",
    "Hardware",
    "ModelTensors",
    "Scenario",
    "Timing",
    "Traffic",
    "forecast",
    "hardware",
    "model_tensors",
]
