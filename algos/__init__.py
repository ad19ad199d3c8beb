"""Algorithms written once over polyrl.tensor (installed as ``polyrl.algos``).

Modules: ``advantages`` (GAE, GRPO, RLOO, REINFORCE++, ReMax), ``losses`` (policy / value /
KL / DPO / Bradley-Terry losses and ``aggregate``), ``kl`` (KL-in-reward and its
controllers), ``dapo`` (dynamic sampling, overlong shaping), ``distillation`` (on-policy
distillation advantages), ``spec`` (``AlgorithmSpec``) and ``registry``
(``get_algorithm(name)``). docs/algorithms.md has the math.
"""

from polyrl.algos.registry import algorithm_names, get_algorithm

__all__ = ["get_algorithm", "algorithm_names"]
