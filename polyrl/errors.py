"""The configuration error every check raises (validate-config, the gin layer, the
cluster checks), in a module of its own so those modules need not import each other."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """The configuration cannot run; ``problems`` lists every finding."""

    def __init__(self, problems: list[str], warnings: list[str] | None = None):
        self.problems, self.warnings = problems, list(warnings or ())
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))
