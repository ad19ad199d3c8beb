"""Algorithms written once over polyrl.tensor (installed as ``polyrl.algos``)."""
