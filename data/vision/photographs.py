"""The embedded photographs: four public-domain / CC0 photographs copied, offline, from the
installed scikit-image wheel (which ships them in ``skimage/data/``) into
``datasets/images/photographs/`` by ``python -m data prepare``.

Their SHA-256 are pinned here and checked on every copy, so a different scikit-image release
that changed a file is a DataError naming it, never a silent change of the test images. They
serve the preprocessing parity tests (tests/data/test_images.py) and demos.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from core.exceptions import DataError, UsageError

DEFAULT_DIR = Path("datasets/images/photographs")
COMPLETE = ".complete"
"""Written last, holding the pinned table it was made from; the up-to-date check reads it."""
PACKAGE = "skimage"


@dataclass(frozen=True)
class Photograph:
    """One pinned photograph."""

    file: str
    """File name, in the wheel's skimage/data/ and in the output directory."""
    sha256: str
    """SHA-256 of the file's bytes."""
    width: int
    """Width in pixels."""
    height: int
    """Height in pixels."""
    licence: str
    """Its terms as scikit-image states them."""


PHOTOGRAPHS = {
    "astronaut": Photograph("astronaut.png", "88431cd9653ccd539741b555fb0a46b61558b301d4110412b5bc28b5e3ea6cb5",
                            512, 512, "public domain (NASA, Eileen Collins)"),
    "chelsea": Photograph("chelsea.png", "596aa1e7cb875eb79f437e310381d26b338a81c2da23439704a73c4651e8c4bb",
                          451, 300, "CC0 (Stefan van der Walt)"),
    "coffee": Photograph("coffee.png", "cc02f8ca188b167c775a7101b5d767d1e71792cf762c33d6fa15a4599b5a8de7",
                         600, 400, "CC0 (Rachel Michetti)"),
    "rocket": Photograph("rocket.jpg", "c2dd0de7c538df8d111e479619b129464d0269d0ae5fd18ca91d33a7fdfea95c",
                         640, 427, "public domain (SpaceX, DSCOVR launch)"),
}
"""The photographs by name, as scikit-image 0.26 ships them."""


def wheel_directory() -> Path:
    """The installed scikit-image's data directory (found without importing the package)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("scikit-image is not installed: the photographs are copied from its wheel",
                         hint="pip install scikit-image (requirements-dev.txt; `make setup` installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def verified_bytes(path: Path, photograph: Photograph) -> bytes:
    """The file's bytes if their SHA-256 is the pinned one, else a DataError naming the file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"photograph {photograph.file} is missing", file=str(path),
                        hint="run `python -m data prepare` (needs scikit-image installed)") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != photograph.sha256:
        raise DataError(f"photograph {photograph.file} has sha256 {digest}, pinned {photograph.sha256}",
                        file=str(path), hint="reinstall scikit-image (requirements-dev.txt) and run "
                                             "`python -m data prepare --force`")
    return data


def photograph_path(name: str, root: Path = DEFAULT_DIR) -> Path:
    """Where the photograph ``name`` (a key of PHOTOGRAPHS) is after prepare, checked against its pin."""
    if name not in PHOTOGRAPHS:
        raise UsageError(f"no photograph named {name!r}", hint=f"one of {', '.join(sorted(PHOTOGRAPHS))}")
    path = root / PHOTOGRAPHS[name].file
    verified_bytes(path, PHOTOGRAPHS[name])
    return path


def _spec() -> dict:
    return {name: asdict(p) for name, p in sorted(PHOTOGRAPHS.items())}


def copy_photographs(out: Path = DEFAULT_DIR, *, force: bool = False, source: Path | None = None) -> bool:
    """Copy the pinned photographs from scikit-image's wheel (or ``source``) into ``out``, each
    checked against its SHA-256; False when ``out`` already holds them (its stamp matches)."""
    stamp = out / COMPLETE
    if not force and stamp.is_file() and json.loads(stamp.read_text()) == _spec():
        return False
    source = wheel_directory() if source is None else source
    files = {p.file: verified_bytes(source / p.file, p) for p in PHOTOGRAPHS.values()}
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for file, data in files.items():
            (tmp / file).write_bytes(data)
        (tmp / COMPLETE).write_text(json.dumps(_spec(), indent=1) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return True
