"""Reading a JSON or TOML file with errors that name the file, raised as the caller's error type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as the tomli package
    import tomli as tomllib


def read_json(path: Path, error: type[Exception]) -> Any:
    return _parse(path, error, json.loads, json.JSONDecodeError, "JSON")


def read_toml(path: Path, error: type[Exception]) -> dict[str, Any]:
    return _parse(path, error, tomllib.loads, tomllib.TOMLDecodeError, "TOML")


def _text(path: Path, error: type[Exception]) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror}") from None


def _parse(path: Path, error: type[Exception], parse, decode_error: type[Exception], kind: str) -> Any:
    text = _text(path, error)
    try:
        return parse(text)
    except decode_error as e:
        raise error(f"{path}: not valid {kind}: {e}") from None
