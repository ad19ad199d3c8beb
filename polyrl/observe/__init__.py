"""What a run shows about itself: the timeline, profiler traces, health warnings, the
three-way shadow check and the remote debugger. Imports the core only (batch, tensor,
config, errors, faults, checkpoints)."""
