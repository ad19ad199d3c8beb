"""The configuration error every check raises (validate-config, the gin layer, the
cluster checks), in a module of its own so those modules need not import each other."""

from __future__ import annotations

__all__ = ["ConfigError", "raise_if_problems"]


class ConfigError(ValueError):
    """The configuration cannot run; ``problems`` lists every finding."""

    def __init__(self, problems: list[str], warnings: list[str] | None = None):
        self.problems, self.warnings = problems, list(warnings or ())
        super().__init__("invalid configuration:\n  " + "\n  ".join(problems))


def raise_if_problems(problems: list[str]) -> None:
    """Raise one :class:`ConfigError` listing ``problems`` (nothing when empty). A config
    dataclass's ``__post_init__`` collects every problem of its fields and calls this, so
    one run names them all (polyrl.configure.bindings reports each on its own line)."""
    if problems:
        raise ConfigError(problems)
