"""The three disjoint text sets, all available offline.

* **Calibration**: what GPTQ and AWQ collect their statistics on.
* **Selection**: what the automatic search compares its candidates on.
* **Test**: scored once, for the chosen configuration's report; never used to choose.

Each set holds code and prose from sources no other set uses:

* Code: CPython's own standard-library sources, which fit the code models. The selection and
  test sets each hold out a fixed list of modules; calibration samples come from the rest.
* Prose: public-domain works shipped in ``fastdraft/quant/texts/<set>/`` (see its README), one
  folder per set, with no book or document in two folders.

The user's own text can replace or join them: :func:`split_texts` splits it into the three
parts (by file, or by window), and :class:`QuantTexts` says what each part of a search holds.
"""

from __future__ import annotations

import os
import random
import sysconfig
from dataclasses import dataclass, field
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

    def scored(self) -> list[tuple[list[EvalText], int | None]]:
        """Groups of texts with how many tokens of each are scored (``None``: all)."""
        return [(self.texts(), self.max_tokens_per_text)]

    def describe(self) -> str:
        return f"built-in {self.name} set"

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


def read_text_paths(paths: list[str | Path]) -> list[EvalText]:
    """The texts of ``paths``, each a file or a folder (every file under it), as
    :func:`read_text_files` reads them."""
    return read_text_files([p for p in paths if not Path(p).is_dir()], [p for p in paths if Path(p).is_dir()])


def calibration_samples(tokenizer: Tokenizer, num_samples: int, seq_len: int, seed: int = 0,
                        prose_fraction: float = 0.25, user_texts: tuple[EvalText, ...] = (),
                        user_fraction: float = 1.0) -> list[torch.Tensor]:
    """``num_samples`` windows of ``seq_len`` token ids ([1, seq_len] each), drawn
    deterministically: ``user_fraction`` of them from ``user_texts`` (when given), the rest
    from calibration code files and calibration prose."""
    rng = random.Random(seed)
    samples: list[torch.Tensor] = []
    num_user = min(round(num_samples * user_fraction), num_samples) if user_texts else 0
    if num_user:
        user_ids = tokenizer.encode("\n\n".join(t.text for t in user_texts))
        if len(user_ids) <= seq_len:
            raise ValueError(f"the calibration text holds {len(user_ids)} tokens, fewer than one calibration window "
                             f"of {seq_len + 1}")
        for _ in range(num_user):
            start = rng.randrange(len(user_ids) - seq_len)
            samples.append(torch.tensor([user_ids[start:start + seq_len]]))
    num_samples -= num_user
    prose = [_read(p) for p in prose_files("calibration")]
    code_files = calibration_code_files()
    num_prose = min(round(num_samples * prose_fraction), num_samples) if prose else 0
    prose_ids = tokenizer.encode("\n\n".join(prose)) if prose else []
    for _ in range(num_prose):
        if len(prose_ids) <= seq_len:
            break
        start = rng.randrange(len(prose_ids) - seq_len)
        samples.append(torch.tensor([prose_ids[start:start + seq_len]]))
    attempts = 0
    while len(samples) < num_user + num_samples:
        attempts += 1
        if attempts > 50 * num_samples:
            raise ValueError("could not find enough calibration text of the requested length")
        ids = tokenizer.encode(_read(rng.choice(code_files)))
        if len(ids) <= seq_len:
            continue
        start = rng.randrange(len(ids) - seq_len)
        samples.append(torch.tensor([ids[start:start + seq_len]]))
    return samples


# The user's text is split by tokens: a fifth to calibration, the rest evenly between selection
# and test. Scoring is capped at about the built-in sets' sizes (every candidate is scored on the
# selection part; the test part once): whole files are scored up to their share of the cap, so
# that many files are sampled rather than a few whole; windows of one text beyond the cap go to
# calibration, which only ever draws its windows from it.
SPLIT_SHARES = (("calibration", 0.2), ("selection", 0.4), ("test", 0.4))
SPLIT_MAX_TOKENS = {"selection": 16384, "test": 32768}
# Windows a part needs: an interval over fewer windows says little.
SPLIT_MIN_WINDOWS = {"calibration": 1, "selection": 4, "test": 4}
USER_DOMAIN = "user"  # the domain of the user's text in intervals and reports


@dataclass(frozen=True)
class GivenTexts:
    """One part of the user's text (whole files, or windows of them), optionally beside a
    built-in set: scored like a :class:`TextSet`."""

    name: str
    given: tuple[EvalText, ...]
    num_tokens: int  # of the given texts, whole
    max_tokens_per_text: int | None = None
    builtin: TextSet | None = None

    def scored(self) -> list[tuple[list[EvalText], int | None]]:
        groups = [(list(self.given), self.max_tokens_per_text)]
        return groups + (self.builtin.scored() if self.builtin is not None else [])

    def describe(self) -> str:
        text = _listing(self.given, self.num_tokens)
        return text + (f"; and the {self.builtin.describe()}" if self.builtin is not None else "")


def _listing(texts: tuple[EvalText, ...], num_tokens: int, num_shown: int = 6) -> str:
    """``"12 of your texts (34567 tokens) in docs/: a.md, b.md, ... and 10 more"``."""
    names = [t.name for t in texts]
    try:  # the folder they share, named once
        folder = os.path.commonpath([os.path.dirname(name) for name in names])
    except ValueError:  # absolute and relative names mixed
        folder = ""
    where = f" in {folder.rstrip(os.sep)}{os.sep}" if folder else ""
    if folder:
        names = [os.path.relpath(name, folder) for name in names]
    more = f" and {len(names) - num_shown} more" if len(names) > num_shown else ""
    return f"{len(names)} of your texts ({num_tokens} tokens){where}: {', '.join(names[:num_shown])}{more}"


@dataclass(frozen=True)
class QuantTexts:
    """What the automatic search reads: the selection and test sets, and the calibration text
    (the user's, or ``()`` for the built-in). ``how`` says how they were made, for the report."""

    selection: TextSet | GivenTexts = SELECTION
    test: TextSet | GivenTexts = TEST
    calibration: tuple[EvalText, ...] = ()
    is_calibration_mixed: bool = False  # the user's calibration text beside the built-in, half each
    how: str = "the built-in sets"
    calibration_tokens: int = 0

    @property
    def is_mixed(self) -> bool:
        """The user's text beside the built-in domains in the selection set: then a candidate
        must also be within the target on the user's own text."""
        return isinstance(self.selection, GivenTexts) and self.selection.builtin is not None

    def describe(self) -> dict[str, str]:
        """What each part holds, in words, for the report."""
        calibration = "the built-in calibration set"
        if self.calibration:
            calibration = _listing(self.calibration, self.calibration_tokens) + (
                f"; and {calibration}" if self.is_calibration_mixed else "")
        return {"calibration": calibration, "selection": self.selection.describe(), "test": self.test.describe()}


def _windows_of(tokenizer: Tokenizer, text: EvalText, num_tokens: int) -> list[EvalText]:
    """``text`` cut at token boundaries into pieces of ``num_tokens`` tokens, named
    ``NAME#i``."""
    offsets = tokenizer.backend.encode(text.text, add_special_tokens=False).offsets
    starts = [offsets[i][0] for i in range(0, len(offsets), num_tokens)] + [len(text.text)]
    return [EvalText(f"{text.name}#{i}", text.text[a:b], USER_DOMAIN)
            for i, (a, b) in enumerate(zip(starts, starts[1:])) if text.text[a:b].strip()]


def _num_windows(num_tokens: int, seq_len: int) -> int:
    return -(-(num_tokens - 1) // seq_len) if num_tokens >= 2 else 0


@dataclass
class _Part:
    name: str
    target: float
    texts: list[EvalText] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    @property
    def fill(self) -> float:
        return sum(self.counts) / self.target if self.target > 0 else float("inf")


def _assign(units: list[EvalText], counts: list[int], seed: int, is_capped: bool) -> dict[str, _Part]:
    """Deal ``units`` (shuffled by ``seed``) to the part least full against its token target;
    ``is_capped``: the scored parts' targets stop at their caps."""
    total = sum(counts)
    parts = {name: _Part(name, share * total) for name, share in SPLIT_SHARES}
    for name, cap in SPLIT_MAX_TOKENS.items():
        if is_capped:
            parts["calibration"].target += max(parts[name].target - cap, 0)
            parts[name].target = min(parts[name].target, cap)
    order = list(range(len(units)))
    random.Random(seed).shuffle(order)
    for i in order:
        # Ties go to test, then selection: the first units fill the scored parts.
        part = min((parts["test"], parts["selection"], parts["calibration"]), key=lambda p: p.fill)
        part.texts.append(units[i])
        part.counts.append(counts[i])
    return parts


def _is_enough(parts: dict[str, _Part], seq_len: int) -> bool:
    return all(sum(_num_windows(c, seq_len) for c in parts[name].counts) >= need
               for name, need in SPLIT_MIN_WINDOWS.items())


def split_texts(tokenizer: Tokenizer, texts: list[EvalText], seq_len: int, seed: int = 0,
                mix_builtin: bool = False) -> QuantTexts:
    """The user's ``texts`` split into disjoint calibration, selection and test parts, seeded:
    by file when there are enough files for each part to get its windows, else by window
    (pieces of ``seq_len`` tokens, dealt out at random). ``mix_builtin`` sets the built-in
    sets beside each part. ``ValueError`` when the text is too short to split."""
    texts = [EvalText(t.name, t.text, USER_DOMAIN) for t in texts]
    parts, by_window = None, False
    if len(texts) >= len(SPLIT_SHARES):
        parts = _assign(texts, [len(tokenizer.encode(t.text)) for t in texts], seed, is_capped=False)
        how = f"by file, seed {seed}"
    if parts is None or not _is_enough(parts, seq_len):
        pieces = [piece for t in texts for piece in _windows_of(tokenizer, t, seq_len)]
        counts = [len(tokenizer.encode(p.text)) for p in pieces]
        needed = sum(SPLIT_MIN_WINDOWS.values())
        if len(pieces) < needed:
            raise ValueError(f"the text holds {sum(counts)} tokens, too short to split into calibration, selection "
                             f"and test parts: at least {needed} windows of {seq_len} tokens are needed")
        parts, by_window = _assign(pieces, counts, seed, is_capped=True), True
        how = f"by window of {seq_len} tokens, seed {seed}"
    if not _is_enough(parts, seq_len):  # a few long pieces can leave a part short; a rare edge
        raise ValueError(f"the text is too short to split into calibration, selection and test parts with "
                         f"{SPLIT_MIN_WINDOWS['selection']} windows of {seq_len} tokens each to select and test on")
    sets = {}
    for name in ("selection", "test"):
        part = parts[name]
        # Each text's share of the cap, so that no long file fills a part alone; a piece is one
        # window (cut again, it can come out a token or two longer).
        cap = seq_len if by_window else max(seq_len, SPLIT_MAX_TOKENS[name] // len(part.texts))
        sets[name] = GivenTexts(name, tuple(part.texts), sum(part.counts), cap,
                                {"selection": SELECTION, "test": TEST}[name] if mix_builtin else None)
    calibration = parts["calibration"]
    return QuantTexts(sets["selection"], sets["test"], tuple(calibration.texts), mix_builtin,
                      f"your text, split {how}" + (", beside the built-in sets" if mix_builtin else ""),
                      sum(calibration.counts))


def given_texts(tokenizer: Tokenizer, calibration: list[EvalText] | None, selection: list[EvalText] | None,
                test: list[EvalText] | None, seq_len: int, mix_builtin: bool = False) -> QuantTexts:
    """The parts the user gave one by one; a part not given stays built-in. ``ValueError`` for
    a file in two parts, or a selection or test part too short to score."""
    seen: dict[str, str] = {}
    for name, part in (("calibration", calibration), ("selection", selection), ("test", test)):
        for text in part or []:
            key = str(Path(text.name).resolve())
            if key in seen:
                raise ValueError(f"{text.name} is in both the {seen[key]} and the {name} text")
            seen[key] = name
    sets: dict[str, TextSet | GivenTexts] = {"selection": SELECTION, "test": TEST}
    for name, part in (("selection", selection), ("test", test)):
        if part is None:
            continue
        part = [EvalText(t.name, t.text, USER_DOMAIN) for t in part]
        counts = [len(tokenizer.encode(t.text)) for t in part]
        num_windows = sum(_num_windows(c, seq_len) for c in counts)
        if num_windows < SPLIT_MIN_WINDOWS[name]:
            raise ValueError(f"the {name} text holds {sum(counts)} tokens, too short: at least "
                             f"{SPLIT_MIN_WINDOWS[name]} windows of {seq_len} tokens are needed")
        cap = max(seq_len, SPLIT_MAX_TOKENS[name] // len(part))
        sets[name] = GivenTexts(name, tuple(part), sum(counts), cap, sets[name] if mix_builtin else None)
    calibration_tokens = sum(len(tokenizer.encode(t.text)) for t in calibration or [])
    return QuantTexts(sets["selection"], sets["test"], tuple(calibration or ()), mix_builtin and bool(calibration),
                      "your text, as given" + (", beside the built-in sets" if mix_builtin else ""),
                      calibration_tokens)
