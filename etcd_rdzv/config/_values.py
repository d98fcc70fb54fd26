"""How the option table reads simple values: booleans, integers, numbers, files, and the
checks of options whose text has a form (``health_check``, ``key_prefix``) or that
need something installed (``api=v2``). Each error names the option and the value."""

from __future__ import annotations

import importlib.util
import math
import os
import shlex
from typing import Any

__all__ = [
    "as_bool",
    "as_int",
    "as_number",
    "check_api_installed",
    "check_health_check",
    "check_key_prefix",
    "readable_file",
]

#: What ``api=v2`` imports, by top-level module, and the distribution that brings it:
#: the ``v2`` extra (python-etcd, urllib3; python-etcd pulls dnspython).
_V2_MODULES = {"etcd": "python-etcd", "urllib3": "urllib3", "dns": "dnspython"}

_TRUE = {"1", "true", "t", "yes", "y"}
_FALSE = {"0", "false", "f", "no", "n"}


def as_bool(key: str, value: Any) -> bool | None:
    """``value`` as a bool (1/0, true/false, yes/no, t/f, y/n); ``None`` stays ``None``.

    Raises:
        ValueError: naming ``key`` and the value.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        if value.strip().lower() in _TRUE:
            return True
        if value.strip().lower() in _FALSE:
            return False
    raise ValueError(f"Option {key!r} must be a boolean (true/false), got {value!r}.")


def as_int(key: str, value: Any) -> int | None:
    """``value`` as an int (an int, or a string of one); ``None`` stays ``None``.

    Raises:
        ValueError: naming ``key`` and the value.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"Option {key!r} must be an integer, got {value!r}.")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError(f"Option {key!r} must be an integer, got {value!r}.")


def as_number(key: str, value: Any) -> float | None:
    """``value`` as a finite float (an int, a float, or a string of one); ``None``
    stays ``None``.

    Raises:
        ValueError: naming ``key`` and the value.
    """
    if value is None:
        return None
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        raise ValueError(f"Option {key!r} must be a number, got {value!r}.")
    return number


def readable_file(key: str, path: Any) -> str:
    """``path`` if it names a file this process can read (it is opened once, and
    closed unread: ``os.access`` would call every file readable for root).

    Raises:
        ValueError: naming ``key``, the path and what is wrong with it (it does not
            exist, it is a directory, it cannot be read, and why).
    """
    if not isinstance(path, str) or not path:
        raise ValueError(f"Option {key!r} must be a file path, got {path!r}.")
    if os.path.isdir(path):
        raise ValueError(f"Option {key!r}: {path!r} is a directory, not a file.")
    if not os.path.exists(path):
        raise ValueError(f"Option {key!r}: file {path!r} does not exist.")
    if not os.path.isfile(path):
        raise ValueError(f"Option {key!r}: {path!r} is not a regular file.")
    try:
        # Non-blocking: a file that became a FIFO since the check above cannot hang.
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError as exc:
        raise ValueError(
            f"Option {key!r}: file {path!r} is not readable by this process "
            f"({exc.strerror or exc})."
        ) from None
    return path


def check_health_check(value: Any) -> str:
    """``python:<module>:<function>`` (imported when the check runs, not here), or a
    command line (shlex-split, run without a shell)."""
    text = value.strip() if isinstance(value, str) and len(value) <= 4096 else ""
    if text.startswith("python:"):
        parts = text.split(":")
        names = [p for part in parts[1:] for p in part.split(".")]
        ok = len(parts) == 3 and all(name.isidentifier() for name in names)
    else:
        try:
            ok = bool(shlex.split(text)) and "\x00" not in text
        except ValueError:
            ok = False
    if not ok:
        raise ValueError(
            "Option 'health_check' must be a command line or python:<module>:<function>, "
            f"got {value!r}."
        )
    return text


def check_key_prefix(value: Any) -> str:
    if (
        not isinstance(value, str)
        or not value.startswith("/")
        or value == "/"
        or "//" in value
        or any(not (c.isascii() and (c.isalnum() or c in "/._-")) for c in value)
    ):
        raise ValueError(
            "Option 'key_prefix' must be an absolute etcd path such as '/etcd_rdzv' "
            f"(letters, digits, '/', '.', '_', '-'), got {value!r}."
        )
    return value.rstrip("/")


def check_api_installed(api: str) -> str:
    """``api``, once what it needs is installed: ``v2`` needs the ``v2`` extra
    (python-etcd and urllib3), ``v3`` nothing. Looks for the modules without importing
    them (no network I/O, nothing loaded).

    Raises:
        ValueError: naming the option, the value, what is missing and the install
            command.
    """
    if api != "v2":
        return api
    missing = [dist for mod, dist in _V2_MODULES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise ValueError(
            f"Option 'api' is {api!r}, which needs the v2 extra (python-etcd and urllib3); "
            f"not installed here: {', '.join(missing)}. Install it with "
            "pip install 'etcd-rdzv[v2]', or use api=v3 (the default; etcd 3.4 or newer)."
        )
    return api
