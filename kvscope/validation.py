"""Reading YAML files and reporting pydantic errors the same way everywhere: the file, the field, the reason."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError


def read_yaml(path: Path, what: str, error: type[ValueError]) -> object:
    """The parsed file, or `error` saying which file and why it could not be read."""
    try:
        return yaml.safe_load(path.read_text())
    except OSError as problem:
        raise error(f"{path}: cannot read {what}: {problem.strerror}") from None
    except yaml.YAMLError as problem:
        raise error(f"{path}: not valid YAML: {problem}") from None


def describe(error: ValidationError, origin: str, what: str, prefix: str = "") -> list[str]:
    """`origin: invalid what`, then one `  dotted.field: reason` line per problem."""
    lines = [f"{origin}: invalid {what}"]
    for problem in error.errors():
        where = prefix + ".".join(_field(part) for part in problem["loc"] if not _wrapper(part))
        lines.append(f"  {where or '(top level)'}: {problem['msg'].removeprefix('Value error, ')}")
    return lines


def _wrapper(part: str | int) -> bool:
    """A validator's wrapper ("function-after[...]"), a tagged union's branch ("union-...") or the mark of a dict
    key ("[key]"): not fields."""
    return str(part).startswith(("function-", "union-")) or part == "[key]"


def _field(part: str | int) -> str:
    """A location part as written, but a key from the input that is not a plain name (an arm named "a/b\n")
    quoted, so what is printed is one line and shows the key exactly."""
    return str(part) if isinstance(part, int) or part.isidentifier() else repr(part)
