"""The documentation's tables of options, made from the option table.

``docs/configuration.md`` (every option) and ``docs/cli.md`` (the connection flags)
hold them between marker lines; a unit test keeps them equal to what this module
makes. After changing :mod:`etcd_rdzv.config._options`, rewrite them from a checkout::

    python3 -m etcd_rdzv.config.docs --write

Without ``--write`` it prints the tables.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ._options import DEFAULT_ENDPOINT, ENV_ENDPOINT, OPTIONS, Option

__all__ = ["BLOCKS", "cli_table", "configuration_table", "replace_block"]

_READERS = {
    "client": "client",
    "store": "stores",
    "handler": "every handler",
    "native": "native handler",
    "static": "static handler",
}


def _code(text: str) -> str:
    return f"`{text}`"


def _sentence(text: str) -> str:
    text = text[0].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def _default(opt: Option) -> str:
    if opt.default is None:
        value = "none"
    elif isinstance(opt.default, bool):
        value = _code(str(opt.default).lower())
    else:
        value = _code(str(opt.default))
    return f"`${opt.env}`, else {value}" if opt.env else value


def configuration_table() -> str:
    """The table of ``docs/configuration.md``: every option, in the table's order."""
    rows = [
        "| option | value | default | read by | flag | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for opt in OPTIONS:
        value = "a boolean" if opt.kind == "bool" else opt.requirement
        meaning = " ".join(t for t in (_sentence(opt.help), opt.details) if t)
        flag = _code(opt.flag) if opt.cli else ""
        rows.append(
            f"| {_code(opt.name)} | {value} | {_default(opt)} | {_READERS[opt.reader]} "
            f"| {flag} | {meaning} |"
        )
    return "\n".join(rows) + "\n"


def cli_table() -> str:
    """The table of ``docs/cli.md``: the flags every command that reaches etcd takes."""
    rows = [
        "| flag | default | option |",
        "|---|---|---|",
        f"| `--endpoint HOST[:PORT][,...]` | `${ENV_ENDPOINT}`, else `{DEFAULT_ENDPOINT}` "
        "| `endpoint` |",
    ]
    for opt in OPTIONS:
        if opt.cli != "etcd":
            continue
        if opt.kind == "bool":
            flag, default = opt.flag, "off"
        else:
            metavar = "{" + ",".join(opt.choices) + "}" if opt.choices else opt.metavar
            flag, default = f"{opt.flag} {metavar}", _default(opt)
        if opt.cli_env:
            default = f"`${opt.cli_env}`, else {default}"
        rows.append(f"| {_code(flag)} | {default} | {_code(opt.name)} |")
    return "\n".join(rows) + "\n"


#: The generated blocks: the file under ``docs/``, and the function that makes it.
BLOCKS = {"configuration.md": configuration_table, "cli.md": cli_table}

_BEGIN = "<!-- options table: made by python3 -m etcd_rdzv.config.docs; edit _options.py -->\n"
_END = "<!-- end of options table -->\n"


def replace_block(document: str, table: str) -> str:
    """``document`` with the text between its marker lines replaced by ``table``.

    Raises:
        ValueError: the document has no pair of marker lines.
    """
    pattern = re.compile(re.escape(_BEGIN) + r".*?" + re.escape(_END), re.DOTALL)
    if not pattern.search(document):
        raise ValueError("no options table markers in the document")
    return pattern.sub(lambda _: _BEGIN + table + _END, document, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m etcd_rdzv.config.docs")
    parser.add_argument(
        "--write", action="store_true", help="rewrite the tables in docs/ of this checkout"
    )
    args = parser.parse_args(argv)
    docs = Path(__file__).resolve().parents[2] / "docs"
    for name, make in BLOCKS.items():
        if args.write:
            path = docs / name
            path.write_text(replace_block(path.read_text(encoding="utf-8"), make()), "utf-8")
            print(f"wrote {path}")
        else:
            print(f"{name}:\n{make()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
