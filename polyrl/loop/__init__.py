"""The run loop: the single-controller trainer (RL, preference, SFT), rollouts generated
ahead (async), validation, metrics and rollout dumps. Imports everything below it (the
core, observe/, cluster/, data/, rewards/, envs/, rollout/, weight_sync/, algos/), never
configure/."""
