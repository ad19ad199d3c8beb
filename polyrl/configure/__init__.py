"""From gin files to runs: the gin layer (bindings, launch), the checks before any
worker starts (validate), sweeps over Ray Tune, and the offline commands that start from
a run directory (export, diagnose). The top floor below cli.py."""
