"""Text for calibration and for the perplexity gate, available offline on every machine.

The built-in corpus is the docstrings of Python standard-library modules
(the module's, then its public classes', methods' and functions' in name
order), collected with ``inspect`` from two fixed, disjoint lists of modules:
one for calibration, one held out for perplexity, so the gate never scores a
model on the text its scales were fitted to. English technical prose with code
in it, like much of what a served model sees. Docstrings change a little
between Python releases, so the texts are fixed per interpreter version.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

CALIBRATION_MODULES = (
    "argparse", "asyncio.events", "asyncio.tasks", "collections", "concurrent.futures", "configparser",
    "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum",
    "fractions", "functools", "gzip", "heapq", "http.client", "inspect", "ipaddress", "json", "logging",
)
HELD_OUT_MODULES = (
    "pathlib", "pickle", "pprint", "queue", "random", "shutil", "statistics", "string", "subprocess",
    "tarfile", "textwrap", "threading", "typing", "unittest.case", "urllib.parse", "uuid", "zipfile",
)
MIN_CHARS = 200  # shorter docstrings ("Return self.") carry little signal per forward pass


def _members(module: object) -> list[object]:
    """Public classes and functions defined in ``module`` (not re-exported), and the classes' methods."""
    found: list[object] = []
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            found.append(obj)
            found.extend(m for n, m in sorted(vars(obj).items()) if not n.startswith("_") and inspect.isfunction(m))
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            found.append(obj)
    return found


def module_docstrings(module_names: tuple[str, ...], min_chars: int = MIN_CHARS) -> list[str]:
    """Docstrings of ``module_names`` in a deterministic order, without duplicates or short ones."""
    texts: list[str] = []
    seen: set[str] = set()
    for module_name in module_names:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a trimmed-down Python build: fewer texts, same order
            continue
        for obj in [module, *_members(module)]:
            raw = getattr(obj, "__doc__", None)  # its own docstring; inspect.getdoc would inherit a base class's
            doc = inspect.cleandoc(raw) if isinstance(raw, str) else ""
            if len(doc) >= min_chars and doc not in seen:
                seen.add(doc)
                texts.append(doc)
    return texts


def text_lines(path: str, limit: int, what: str = "file") -> list[str]:
    """The first ``limit`` non-empty lines of ``path``, stripped; ValueError naming ``what`` when there are none."""
    lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()]
    texts = [line for line in lines if line]
    if not texts:
        raise ValueError(f"{what} {path} has no non-empty lines")
    return texts[:limit]


def calibration_texts(calib_data: str, limit: int) -> tuple[list[str], str]:
    """(up to ``limit`` calibration texts, a description of where they came from)."""
    if calib_data:
        return text_lines(calib_data, limit, "calibration file"), f"file {calib_data}"
    return module_docstrings(CALIBRATION_MODULES)[:limit], f"stdlib docstrings ({len(CALIBRATION_MODULES)} modules)"


def held_out_texts(limit: int) -> tuple[list[str], str]:
    """(up to ``limit`` perplexity texts, disjoint from the built-in calibration corpus, a description)."""
    calibration = set(module_docstrings(CALIBRATION_MODULES))  # a docstring shared by both lists stays out
    texts = [text for text in module_docstrings(HELD_OUT_MODULES) if text not in calibration]
    return texts[:limit], f"held-out stdlib docstrings ({len(HELD_OUT_MODULES)} modules)"


def encode_texts(tokenizer_dir: Path, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Token ids of each text as the server would encode it, cut to ``max_tokens``; texts under 2 tokens dropped."""
    from transformers import AutoTokenizer  # heavy; only builds that calibrate or validate need it

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    encoded = [list(tokenizer.encode(text, add_special_tokens=True))[:max_tokens] for text in texts]
    return [ids for ids in encoded if len(ids) >= 2]
