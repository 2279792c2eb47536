"""tdmesh: drive a fleet of PyTorch workers from one Python program."""

from .slice import Slice
from .shape import Shape, UnknownDimError

__all__ = ["Slice", "Shape", "UnknownDimError"]
