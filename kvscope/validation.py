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
        # a validator's wrapper ("function-after[...]") and a tagged union's branch ("union-...") are not fields
        parts = [str(part) for part in problem["loc"] if not str(part).startswith(("function-", "union-"))]
        where = prefix + ".".join(parts)
        lines.append(f"  {where or '(top level)'}: {problem['msg'].removeprefix('Value error, ')}")
    return lines
