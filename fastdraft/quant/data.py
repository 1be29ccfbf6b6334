"""The three disjoint text sets, all available offline.

* **Calibration**: what GPTQ and AWQ collect their statistics on.
* **Selection**: what the automatic search compares its candidates on.
* **Test**: scored once, for the chosen configuration's report; never used to choose.

Each set holds code and prose from sources no other set uses:

* Code: CPython's own standard-library sources, which fit the code models. The selection and
  test sets each hold out a fixed list of modules; calibration samples come from the rest.
* Prose: public-domain works shipped in ``fastdraft/quant/texts/<set>/`` (see its README), one
  folder per set, with no book or document in two folders.
"""

from __future__ import annotations

import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from fastdraft.tokenizer import Tokenizer

TEXTS_DIR = Path(__file__).parent / "texts"

# Held-out standard-library modules (paths relative to the stdlib root).
SELECTION_CODE_FILES = ("argparse.py", "dataclasses.py", "textwrap.py", "fractions.py", "heapq.py")
TEST_CODE_FILES = ("configparser.py", "difflib.py", "calendar.py", "pprint.py", "statistics.py", "tomllib/_parser.py")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def calibration_code_files() -> list[Path]:
    """Standard-library sources usable for calibration: top-level and package modules, minus
    tests and the selection and test modules, in a stable order."""
    root = stdlib_root()
    held_out = {root / f for f in SELECTION_CODE_FILES + TEST_CODE_FILES}
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if path in held_out or any(p in ("test", "tests", "idlelib", "site-packages", "lib2to3") for p in rel):
            continue
        files.append(path)
    return files


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def prose_files(split: str) -> list[Path]:
    """The shipped public-domain prose of one set (``calibration``, ``selection`` or ``test``),
    in a stable order."""
    if split not in ("calibration", "selection", "test"):
        raise ValueError(f"unknown text set {split!r}; choose from calibration, selection, test")
    return sorted((TEXTS_DIR / split).glob("*.txt"))


def calibration_texts() -> list[str]:
    """Every calibration text, whole: the stdlib code files, then the calibration prose."""
    return [_read(p) for p in calibration_code_files() + prose_files("calibration")]


@dataclass(frozen=True)
class EvalText:
    name: str
    text: str
    domain: str = "text"  # "code" or "prose" for the built-in sets; intervals are per domain


@dataclass(frozen=True)
class TextSet:
    """A held-out set: its standard-library modules and its prose folder, and how many tokens
    of each text are scored (so that no single long file dominates)."""

    name: str
    code_files: tuple[str, ...]
    max_tokens_per_text: int

    def texts(self) -> list[EvalText]:
        root = stdlib_root()
        texts = [EvalText(f"stdlib/{f}", _read(root / f), "code") for f in self.code_files if (root / f).is_file()]
        texts += [EvalText(f"prose/{p.stem}", _read(p), "prose") for p in prose_files(self.name)]
        if not texts:
            raise ValueError(f"no {self.name} texts found")
        return texts


# Sized so that each domain has about 8K scored tokens for selection (every candidate is scored
# on it) and about 18K for the test set (scored once, and narrow enough intervals to report).
SELECTION = TextSet("selection", SELECTION_CODE_FILES, max_tokens_per_text=1536)
TEST = TextSet("test", TEST_CODE_FILES, max_tokens_per_text=3072)


def read_text_file(path: str | Path) -> EvalText:
    """One user-supplied evaluation text, whole, named by its path.

    ``ValueError`` for a path that is missing or a folder, and for a file that is empty, holds
    NUL bytes or is not UTF-8: binary data would score as noise, so it is refused."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not a text file (use --text-dir for a folder)")
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    data = path.read_bytes()
    if b"\x00" in data:
        raise ValueError(f"{path} is a binary file, not UTF-8 text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not UTF-8 text (byte {exc.start} cannot be decoded)") from None
    if not text.strip():
        raise ValueError(f"{path} is empty")
    return EvalText(str(path), text)


def read_text_files(paths: list[str | Path] | tuple = (), dirs: list[str | Path] | tuple = ()) -> list[EvalText]:
    """The texts of ``paths`` and of every file under ``dirs`` (hidden ones skipped), each file
    once, in the order given and sorted within a folder. ``ValueError`` for any bad input."""
    files: list[Path] = [Path(p) for p in paths]
    for folder in map(Path, dirs):
        if not folder.is_dir():
            raise ValueError(f"{folder}: no such folder")
        found = sorted(p for p in folder.rglob("*")
                       if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))
        if not found:
            raise ValueError(f"{folder} holds no files")
        files += found
    texts, seen = [], set()
    for path in files:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            texts.append(read_text_file(path))
    if not texts:
        raise ValueError("no text files given")
    return texts


def calibration_samples(tokenizer: Tokenizer, num_samples: int, seq_len: int, seed: int = 0,
                        prose_fraction: float = 0.25) -> list[torch.Tensor]:
    """``num_samples`` windows of ``seq_len`` token ids ([1, seq_len] each), drawn
    deterministically from calibration code files and calibration prose."""
    rng = random.Random(seed)
    prose = [_read(p) for p in prose_files("calibration")]
    code_files = calibration_code_files()
    num_prose = min(round(num_samples * prose_fraction), num_samples) if prose else 0
    samples: list[torch.Tensor] = []
    prose_ids = tokenizer.encode("\n\n".join(prose)) if prose else []
    for _ in range(num_prose):
        if len(prose_ids) <= seq_len:
            break
        start = rng.randrange(len(prose_ids) - seq_len)
        samples.append(torch.tensor([prose_ids[start:start + seq_len]]))
    attempts = 0
    while len(samples) < num_samples:
        attempts += 1
        if attempts > 50 * num_samples:
            raise ValueError("could not find enough calibration text of the requested length")
        ids = tokenizer.encode(_read(rng.choice(code_files)))
        if len(ids) <= seq_len:
            continue
        start = rng.randrange(len(ids) - seq_len)
        samples.append(torch.tensor([ids[start:start + seq_len]]))
    return samples
