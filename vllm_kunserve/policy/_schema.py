"""Small helpers to read JSON objects into snapshots with errors that name the field at fault."""

from __future__ import annotations

from typing import Any, Mapping

_MISSING = object()


def need_mapping(obj: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def need_list(obj: Any, where: str) -> list:
    if not isinstance(obj, (list, tuple)):
        raise ValueError(f"{where}: expected a JSON array, got {type(obj).__name__}")
    return list(obj)


def get(d: Mapping[str, Any], key: str, kind: type | tuple, where: str, default: Any = _MISSING,
        lo: float | None = None, hi: float | None = None) -> Any:
    """Return ``d[key]`` checked against ``kind`` (int, float, bool, str, list, dict) and bounds.

    A missing key without default raises ``ValueError("<where>.<key>: missing required field")``.
    """
    path = f"{where}.{key}" if where else key
    if key not in d or d[key] is None:
        if default is _MISSING:
            raise ValueError(f"{path}: missing required field")
        return default
    v = d[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and int not in kinds:
        kinds = kinds + (int,)
    ok = isinstance(v, kinds) and not (isinstance(v, bool) and bool not in kinds)
    if not ok:
        names = "/".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ValueError(f"{path}={v!r}: expected {names}")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if v != v or v in (float("inf"), float("-inf")):
            raise ValueError(f"{path}={v!r}: expected a finite number")
        if lo is not None and v < lo:
            raise ValueError(f"{path}={v!r}: must be >= {lo}")
        if hi is not None and v > hi:
            raise ValueError(f"{path}={v!r}: must be <= {hi}")
        if float in kinds and not isinstance(v, bool):
            v = float(v) if not (int in (kind if isinstance(kind, tuple) else (kind,))) else v
    return v


def check_unknown(d: Mapping[str, Any], allowed: set[str] | frozenset[str], where: str) -> None:
    extra = sorted(set(d) - set(allowed))
    if extra:
        raise ValueError(f"{where}.{extra[0]}: unknown field; allowed: {', '.join(sorted(allowed))}")
