"""Reading a JSON or TOML file with errors that name the file, raised as the caller's error type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as the tomli package
    import tomli as tomllib


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are unique: json keeps the last of two equal keys silently, so a
    hand-edited file could say one thing and mean another."""
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise _DuplicateKey(f"key {k!r} appears twice in one object")
        d[k] = v
    return d


def _loads_json(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_no_duplicates)


def read_json(path: Path, error: type[Exception]) -> Any:
    return _parse(path, error, _loads_json, (json.JSONDecodeError, _DuplicateKey), "JSON")


def read_toml(path: Path, error: type[Exception]) -> dict[str, Any]:
    return _parse(path, error, tomllib.loads, tomllib.TOMLDecodeError, "TOML")


def read_text(path: Path, error: type[Exception]) -> str:
    """A UTF-8 text file's contents; unreadable files and bytes that are not UTF-8 (a binary or
    Latin-1 file given by mistake) raise ``error`` naming the file, never a bare traceback."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text: byte 0x{e.object[e.start]:02x} at offset {e.start} "
                    f"(is it the right file?)") from None
    except ValueError as e:  # e.g. a NUL byte in the path
        raise error(f"{path}: cannot read: {e}") from None


def _parse(path: Path, error: type[Exception], parse, decode_error: Any, kind: str) -> Any:
    text = read_text(path, error)
    try:
        return parse(text)
    except decode_error as e:
        raise error(f"{path}: not valid {kind}: {e}") from None
    except RecursionError:  # arrays nested thousands deep: no ppiped file is
        raise error(f"{path}: not valid {kind}: nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts (4,300)
        raise error(f"{path}: not valid {kind}: {str(e)[:120]}") from None
