"""Training backends (installed as ``polyrl.backends``). See ``base.TrainEngine``."""

from polyrl.backends.base import ENGINES, LossContext, TrainEngine, get_engine

__all__ = ["ENGINES", "LossContext", "TrainEngine", "get_engine"]
