"""Multi-turn environments, tool calling and the Python sandbox (docs/agents.md).

- ``polyrl.envs.tools``: tools as JSON schemas, the registry, running a turn's calls with
  limits; the built-in ``calculator`` and ``python`` tools.
- ``polyrl.envs.parsers``: tool calls parsed out of a model turn, a parser per format.
- ``polyrl.envs.sandbox``: running code in a limited subprocess.
"""
