"""Mixed precision to an accuracy target: rank layers by sensitivity, bisect how many to
raise up the ladder (`driver.py`, `bisect.py`, `ladder.py`, `target.py`)."""

from onnxq.search.driver import quantize_to_target
from onnxq.search.target import AccuracyTarget, parse_target

__all__ = ["AccuracyTarget", "parse_target", "quantize_to_target"]
