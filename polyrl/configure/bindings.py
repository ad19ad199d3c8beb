"""gin files + ``--gin_param`` -> the bound root configurable, or every binding problem named.

Part of the launcher (with ``polyrl/configure/launch.py`` the only modules that import gin): gin's
own errors stop at the first problem and end in a traceback, so the files are first read
statement by statement and every problem is collected — a syntax error (file, line), an
include that does not exist, an unknown configurable or parameter (with the closest
valid name), a value of the wrong type — then bound, then the leaf configurables are
built scope by scope (so each range error names its scope) and the root last. After a
successful build, a binding that nothing consumed (a misspelled scope) is an error too.
Every problem names the binding, its value, where it was written and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import tokenize
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import gin
from gin import config_parser
from polyrl.config import closest
from polyrl.errors import ConfigError

__all__ = ["bind", "type_problem"]


@dataclasses.dataclass(frozen=True)
class _Binding:
    scope: str
    selector: str
    param: str
    value: Any
    where: str  # "gin/x.gin line 3" or "--gin_param '...'"

    @property
    def name(self) -> str:
        return f"{self.scope + '/' if self.scope else ''}{self.selector}.{self.param}"


def _where(location: Any, param_text: str | None = None) -> str:
    if location is None or not location.filename:
        return f"--gin_param {param_text!r}" if param_text else "--gin_param"
    return f"{location.filename} line {location.line_num}"


def _find(name: str, search: Sequence[Path]) -> Path | None:
    for root in (Path("."), *search):
        path = root / name
        if path.exists():
            return path.resolve()
    return None


class _Reader:
    """Reads gin text into bindings without binding anything; collects problems."""

    def __init__(self, search: Sequence[Path]):
        self.search, self.bindings, self.problems = search, [], []
        self.seen: set[Path] = set()

    def read_file(self, path: Path) -> None:
        if path in self.seen:
            return
        self.seen.add(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            self.problems.append(f"gin file {str(path)!r} cannot be read: {e}")
            return
        self._read(text, str(path), None)

    def read_param(self, text: str) -> None:
        self._read(text, None, text)

    def _read(self, text: str, filename: str | None, param: str | None) -> None:
        stream = io.StringIO(text)
        stream.name = filename  # gin's locations carry the file name
        parser = config_parser.ConfigParser(stream, gin.config.ParserDelegate(False))
        label = filename or f"--gin_param {param!r}"
        try:
            for st in parser:
                if isinstance(st, config_parser.IncludeStatement):
                    found = _find(st.filename, self.search)
                    if found is None:
                        looked = ", ".join(str(p) for p in (Path("."), *self.search))
                        self.problems.append(
                            f"{_where(st.location, param)}: include {st.filename!r} not found "
                            f"(looked in {looked}); fix the path (relative to the repository root)"
                        )
                    else:
                        self.read_file(found)
                elif isinstance(st, config_parser.BindingStatement) and st.arg_name:
                    where = _where(st.location, param)
                    self.bindings.append(
                        _Binding(st.scope or "", st.selector, st.arg_name, st.value, where)
                    )
        except SyntaxError as e:
            loc = e.args[1] if len(e.args) > 1 else None
            line = getattr(loc, "line_num", e.lineno)
            content = (getattr(loc, "line_content", "") or "").strip()
            name, _, value = (part.strip() for part in content.partition("="))
            if _unquoted(value):  # e.g. run_dir = runs/x: gin reads Python literals
                self.problems.append(
                    f"gin syntax error in {label} line {line}: `{content}`: {value} is not a "
                    f"value gin can read; a string (a path, a name) needs quotes: "
                    f'{name} = "{value}"'
                )
                return
            self.problems.append(
                f"gin syntax error in {label} line {line}: {e.args[0]} in `{content}`; "
                f"a binding reads `scope/module.Name.param = value`"
            )
        except tokenize.TokenError as e:
            self.problems.append(
                f"gin syntax error in {label}: {e.args[0]} (an unclosed bracket or string "
                f"ends the file); close it"
            )
        except ValueError as e:  # a reference to an unknown configurable: @Name()
            self.problems.append(f"{label}: {str(e).splitlines()[0]}")


def _unquoted(value: str) -> bool:
    """``value`` (the right of a binding gin could not parse) is a bare word or path a
    user meant as a string: no quote, bracket, reference or macro, not a number."""
    if not value or value[0] in "\"'([{@%" or value in ("True", "False", "None"):
        return False
    try:
        float(value)
        return False
    except ValueError:
        return not any(c.isspace() for c in value) and not value.endswith(("\\", ","))


def _selectors() -> list[str]:
    return sorted({s for s, _ in gin.config._REGISTRY.items()})


def _configurable(selector: str) -> Any:
    try:
        return gin.config._REGISTRY.get_match(selector)
    except KeyError:  # ambiguous
        return None


def _params(fn: Any) -> list[str]:
    import inspect

    return [p for p in inspect.signature(fn).parameters if p != "self"]


def _type_ok(value: Any, hint: Any) -> bool:
    if isinstance(value, gin.config.ConfigurableReference) or hint in (Any, object):
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, arm) for arm in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:
        return isinstance(value, (tuple, list))
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        return isinstance(value, Mapping)
    return True


_TYPE_WORDS = {bool: "True/False", int: "an integer", float: "a number", str: "a quoted string"}


def _type_word(hint: Any) -> str:
    arms = (
        typing.get_args(hint)
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else (hint,)
    )
    words = []
    for arm in arms:
        origin = typing.get_origin(arm) or arm
        words.append(
            "None"
            if arm is type(None)
            else _TYPE_WORDS.get(arm)
            or (
                "a list" if origin is tuple else "a dict" if origin in (dict, Mapping) else str(arm)
            )
        )
    return " or ".join(words)


def _as_type(value: Any, hint: Any) -> Any:
    """``value`` read as the type ``hint`` takes when it means one (``'64'`` -> ``64`` for
    an int, ``'3e-3'`` -> ``0.003`` for a float, ``64.0`` -> ``64``); None otherwise."""
    tries: list[Any] = []
    if isinstance(value, str):
        tries += [{"True": True, "False": False}.get(value.strip())]
        for kind in (int, float):
            with contextlib.suppress(ValueError):
                tries.append(kind(value))
    elif isinstance(value, float) and value.is_integer():
        tries.append(int(value))
    return next((t for t in tries if t is not None and _type_ok(t, hint)), None)


def type_problem(cls: type, field: str, value: Any, name: str, where: str) -> str | None:
    """A message when ``value`` does not fit the annotation of ``cls.field``."""
    hint = typing.get_type_hints(cls).get(field)
    if hint is None or _type_ok(value, hint):
        return None
    fix = ""
    suggested = _as_type(value, hint)
    if suggested is not None:
        how = "without quotes" if isinstance(value, str) else "as"
        fix = f"; write it {how}: {name} = {suggested!r}"
    return (
        f"{name} = {value!r} ({where}) is {type(value).__name__}, expected {_type_word(hint)}{fix}"
    )


def _binding_problems(bindings: Sequence[_Binding]) -> list[str]:
    out = []
    selectors = _selectors()
    for b in bindings:
        found = _configurable(b.selector)
        if found is None:
            short = {s.rsplit(".", 1)[-1]: s for s in selectors}
            guess = closest(b.selector, selectors) or short.get(
                closest(b.selector.rsplit(".", 1)[-1], list(short)) or ""
            )
            hint = f"; did you mean {guess!r}?" if guess else f"; known: {selectors}"
            out.append(f"{b.name} ({b.where}): no configurable named {b.selector!r}{hint}")
            continue
        cls = found.wrapped
        params = _params(cls)
        moved = cls.moved(b.param, b.value) if hasattr(cls, "moved") else None
        if b.param not in params and moved:
            out.append(
                f"{b.name} ({b.where}) is no longer a parameter: each role's settings are "
                f'nested under the role (docs/training.md "Roles"); write {moved} instead'
            )
        elif b.param not in params:
            guess = closest(b.param, params)
            hint = f"did you mean {guess!r}?" if guess else f"valid: {params}"
            out.append(f"{b.name} ({b.where}): {b.selector} has no parameter {b.param!r}; {hint}")
        elif dataclasses.is_dataclass(cls):
            problem = type_problem(cls, b.param, b.value, b.name, b.where)
            if problem:
                out.append(problem)
    return out


def _call_problems(error: Exception, label: str) -> list[str]:
    """The problems of building ``label``: each of a ConfigError (a dataclass's every
    field problem, polyrl.errors.raise_if_problems) prefixed with the scope, or gin's one."""
    if isinstance(error, ConfigError):
        scope = re.search(r"in scope '([^']+)'", str(error))  # gin's note on the call
        where = f"{scope.group(1)}/" if scope else ""
        return [f"{where}{label}: {problem}" for problem in error.problems]
    return [_call_problem(error, label)]


def _scoped_message(problem: str) -> tuple[str, str]:
    """(gin scope, message) of a ``scope/selector: message`` problem."""
    label, _, message = problem.partition(": ")
    return label.rpartition("/")[0], message


def _call_problem(error: Exception, label: str) -> str:
    lines = str(error).splitlines()
    scope = re.search(r"in scope '([^']+)'", str(error))
    head = lines[0] if lines else type(error).__name__
    missing = re.search(r"missing \d+ required positional argument", head)
    if missing and scope and "configurable 'macro'" in str(error):  # %NAME never bound
        return (
            f"gin macro {scope.group(1)} is not bound (REQUIRED by the gin file's header); "
            f"pass --gin_param '{scope.group(1)} = ...'"
        )
    if missing:
        args = re.findall(r"'(\w+)'", head)
        return (
            f"{label}.{', '.join(args)} is REQUIRED and not bound; add e.g. "
            f"`{label}.{args[0] if args else '...'} = ...` to the gin file or --gin_param"
        )
    where = f"{scope.group(1)}/" if scope else ""
    return f"{where}{label}: {head}"


def _operative(text: str) -> set[tuple[str, str]]:
    stream = io.StringIO(text)
    return {
        (st.scope or "", _configurable(st.selector).selector)
        for st in config_parser.ConfigParser(stream, gin.config.ParserDelegate(True))
        if isinstance(st, config_parser.BindingStatement) and st.arg_name
    }


def bind(
    files: Sequence[Path], params: Sequence[str], root: str, search: Sequence[Path]
) -> tuple[Any, str]:
    """Bind ``files`` + ``params`` and build ``root``; ConfigError lists every problem."""
    reader = _Reader(search)
    for path in files:
        reader.read_file(path)
    for text in params:
        reader.read_param(text)
    problems = reader.problems + _binding_problems(reader.bindings)
    if problems:
        raise ConfigError(problems)
    _parse(files, params, search)
    # Leaf configurables first, scope by scope: every range error, each with its scope.
    root_name = root.rsplit(".", 1)[-1]
    for scope, selector in sorted({(b.scope, b.selector) for b in reader.bindings}):
        found = _configurable(selector)
        if found is None or found.selector == _configurable(root).selector:
            continue
        bound = {
            b.param for b in reader.bindings if b.selector == selector and b.scope in ("", scope)
        }
        if any(f.name not in bound for f in _required(found.wrapped)):
            continue  # only the root builds it (with the missing value); errors surface there
        try:
            with gin.config_scope(scope or None):
                gin.get_configurable(found.selector)()
        except (ValueError, TypeError) as e:
            # a nested configurable's problem (the role's OptimConfig) is named once
            # per scope
            said = {_scoped_message(p) for p in problems}
            problems += [
                p for p in _call_problems(e, found.selector) if _scoped_message(p) not in said
            ]
    if problems:
        raise ConfigError(problems)
    _parse(files, params, search)  # again: the leaf builds above count as "used"
    try:
        cfg = gin.get_configurable(root)()
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(_call_problems(e, root)) from None
    operative = gin.operative_config_str()
    used = _operative(operative)
    # Only a run's bindings are all consumed by its root; a sweep's gin files also bind the
    # RunConfig that each trial builds (and checks) itself.
    checked = reader.bindings if root_name == "RunConfig" else []
    for b in checked:
        found = _configurable(b.selector)
        if (b.scope, found.selector) in used or found.selector.endswith("SweepConfig"):
            continue
        if not b.scope and any(sel == found.selector for _, sel in used):
            continue  # an unscoped binding applies in every scope that builds it
        scopes = sorted({s for s, sel in used if sel == found.selector and s})
        guess = closest(b.scope, scopes) if b.scope else None
        fix = (
            f"did you mean scope {guess!r}?"
            if guess
            else f"scopes in use for {found.selector}: {scopes or ['(none)']}"
        )
        problems.append(
            f"{b.name} = {b.value!r} ({b.where}) is never used: nothing builds "
            f"{found.selector} in scope {b.scope!r}; {fix}"
        )
    if problems:
        raise ConfigError(problems)
    return cfg, operative


def _parse(files: Sequence[Path], params: Sequence[str], search: Sequence[Path]) -> None:
    gin.clear_config()
    for path in search:
        gin.add_config_file_search_path(str(path))
    try:
        gin.parse_config_files_and_bindings(
            [str(f) for f in files], list(params), finalize_config=False
        )
    except Exception as e:  # anything the reader did not foresee, still named
        raise ConfigError([str(e).replace("\n", " ")]) from None


def _required(cls: Any) -> list[dataclasses.Field]:
    if not dataclasses.is_dataclass(cls):
        return []
    return [
        f
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
