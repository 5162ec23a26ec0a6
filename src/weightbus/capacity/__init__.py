"""`weightbus plan`: the bytes per rank and the predicted time of a push, for a model given by
its config alone, on a cluster given by its layout and bandwidths (docs/scale.md)."""

from weightbus.capacity.forecast import Forecast, Scenario, forecast
from weightbus.capacity.profiles import PROFILES, hardware
from weightbus.capacity.shapes import ModelTensors, model_tensors
from weightbus.capacity.sharding import EngineLayout
from weightbus.capacity.timing import Hardware, Timing
from weightbus.capacity.traffic import Traffic

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
