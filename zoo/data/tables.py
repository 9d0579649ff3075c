"""Labelled text tables (.tsv, .csv, .jsonl with named columns), read without holding their text in memory.

`TextTable(path, ...)` reads the file once, row by row: it checks every row (a row without a label is refused
with its line number), records the byte offset where each row starts (8 bytes a row) and summarises the label
column (`LabelSummary`: its distinct labels and what kind they are). `table[i]` seeks to row i and parses it
again, so a DataLoader's workers read rows from disk and memory does not grow with the file's text.
"""
from __future__ import annotations

import csv
import json
import math
import os
from array import array
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

__all__ = ["TextTable", "LabelSummary", "read_labelled_texts", "infer_problem", "split_label"]

FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl"}
# Distinct labels a summary keeps: more than this many cannot be classes (a regression column, or free text),
# and a set of them would grow with the file.
MAX_DISTINCT_LABELS = 100_000


def split_label(label: str) -> list[str]:
    """A multi-label row "a,b" -> ["a", "b"] (spaces around names dropped, empty names ignored)."""
    return sorted({name.strip() for name in label.split(",") if name.strip()})


class LabelSummary:
    """What a label column holds, gathered one label at a time: its distinct labels and the names in its comma
    lists (up to MAX_DISTINCT_LABELS each), and the first label of each kind, for the errors."""

    def __init__(self, source: str = "the label column"):
        self.source = source
        self.labels: set[str] = set()
        self.names: set[str] = set()  # the names in comma lists ("a,b": a and b)
        self.overflow = False
        self.count = 0
        # kind -> (row index, label, line or None): "list" ("a,b"), "fraction" (not a whole number, inf and nan too),
        # "text" (no number), "not_finite" (no finite number: what a regression target cannot be)
        self.first: dict[str, tuple[int, str, int | None]] = {}

    @classmethod
    def of(cls, labels, source: str = "the label column") -> "LabelSummary":
        summary = cls(source)
        for label in labels:
            summary.add(label)
        return summary

    def add(self, label: str, line: int | None = None) -> None:
        """One row's raw label; its `line` in the file goes into the errors that name it."""
        self.count += 1
        if label in self.labels:  # its kinds are recorded already: the common case, kept cheap
            return
        kinds = ["list"] if "," in label else []
        try:
            value = float(label)
            if not math.isfinite(value) or value != int(value):
                kinds.append("fraction")
            if not math.isfinite(value):
                kinds.append("not_finite")
        except ValueError:
            kinds += ["text", "not_finite"]
        for kind in kinds:
            self.first.setdefault(kind, (self.count - 1, label, line))
        if self.overflow:
            return
        self.labels.add(label)
        if "," in label:
            self.names.update(split_label(label))
        self.overflow = len(self.labels) > MAX_DISTINCT_LABELS or len(self.names) > MAX_DISTINCT_LABELS

    def __or__(self, other: "LabelSummary") -> "LabelSummary":
        """The summary of both columns (training and evaluation labels together)."""
        both = LabelSummary(f"{self.source} and {other.source}")
        both.labels, both.names = self.labels | other.labels, self.names | other.names
        both.overflow = self.overflow or other.overflow
        both.count = self.count + other.count
        both.first = {**other.first, **self.first}
        return both

    def problem(self) -> str:
        """What the labels ask for: "multi_label" when they are comma lists ("a,b"), "regression" when they are
        numbers and some are not whole ("0.5", "3.8"), else "single_label" (one class name or id per row).
        A column that mixes kinds is an error naming an example of each."""
        lists, fractions, texts = (self.first.get(kind) for kind in ("list", "fraction", "text"))
        if lists and fractions:
            raise ValueError(f"{self.source} mixes comma lists (multi-label, e.g. {lists[1]!r}) with fractional "
                             f"numbers (regression targets, e.g. {fractions[1]!r}); a column holds one kind of "
                             "label, or say which with --problem")
        if lists:
            return "multi_label"
        if fractions and texts:
            raise ValueError(f"{self.source} mixes fractional numbers (regression targets, e.g. {fractions[1]!r}) "
                             f"with text labels (classes, e.g. {texts[1]!r}); a column holds one kind of label, "
                             "or say which with --problem")
        return "regression" if fractions else "single_label"

    def classes(self, problem: str) -> set[str]:
        """The raw class labels (single label) or label names (multi-label)."""
        if self.overflow:
            raise ValueError(f"{self.source} holds more than {MAX_DISTINCT_LABELS:,} distinct labels, too many "
                             f"for classes; is it a regression target (--problem regression) or the wrong column?")
        if problem == "multi_label":
            return self.names | {label for label in self.labels if "," not in label}
        return set(self.labels)

    def check_regression(self) -> None:
        """Every label a finite number, as a regression target must be; else an error naming the first."""
        bad = self.first.get("not_finite")
        if bad:
            index, label, line = bad
            raise ValueError(f"{self.source}{f', line {line}' if line else ''}: label {index} ({label!r}) is not a "
                             "finite number, as a regression target must be")


def infer_problem(labels: list[str], source: str = "the label column") -> str:
    """`LabelSummary.problem` of a list of labels."""
    return LabelSummary.of(labels, source).problem()


class _Lines:
    """The lines of a binary file as text, knowing the byte offset of the next one (csv.reader pulls lines one
    at a time, as a row needs them, so between rows `offset` is where the next row starts)."""

    def __init__(self, f, first: bool = False):
        self.f, self.offset, self.number = f, f.tell(), 0  # number: of the lines read so far
        self.encoding = "utf-8-sig" if first else "utf-8"  # a byte-order mark (Excel's CSVs) is no column name

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line = self.f.readline()
        if not line:
            raise StopIteration
        self.offset += len(line)
        self.number += 1
        try:
            text = line.decode(self.encoding)
        except UnicodeDecodeError as e:
            raise ValueError(f"{self.f.name}, line {self.number}: not UTF-8 ({e.reason} at byte {e.start}); "
                             "save the file as UTF-8") from None
        self.encoding = "utf-8"
        return text


def _reader(lines: _Lines, fmt: str):
    # GLUE TSVs are unquoted; CSVs follow the usual quoting rules (a quoted field may span lines)
    return csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE) if fmt == "tsv" else csv.reader(lines)


class TextTable(Dataset):
    """The rows of a labelled text table: `table[i]` -> (text, or (text, pair) with `pair_column`; raw label).

    .tsv/.csv name their columns in a header line; .jsonl rows are JSON objects, the first one's keys naming
    the columns (a list label ["a", "b"] reads as "a,b"). Texts and labels are stripped of surrounding spaces.
    `labels` summarises the label column.
    """

    def __init__(self, path: str | Path, text_column: str, label_column: str, pair_column: str | None = None):
        from zoo._io import existing
        self.path = existing(path, "file", "data file", "a .tsv, .csv or .jsonl file")
        self.format = FORMATS.get(self.path.suffix.lower())
        if self.format is None:
            raise ValueError(f"{self.path}: unsupported data format {self.path.suffix!r}; use .tsv, .csv or .jsonl")
        self.columns = [text_column, label_column] + ([pair_column] if pair_column else [])
        self.pair = pair_column is not None
        self.labels = LabelSummary(f"--label-column {label_column!r} of {self.path}")
        self._file, self._pid = None, None
        offsets = array("q")  # 8 bytes a row; a list of ints would take 4-5 times that
        with open(self.path, "rb") as f:
            try:
                end = self._scan(f, offsets)
            except csv.Error as e:
                raise ValueError(f"{self.path} is not a readable {self.format.upper()} file ({e})") from None
        if not offsets:
            raise ValueError(f"{self.path} holds no examples (no rows{'' if self.format == 'jsonl' else ' under its header'})")
        self.offsets, self.end = np.frombuffer(offsets, dtype=np.int64), end

    # ------------------------------------------------------------------ the one pass

    def _scan(self, f, offsets: array) -> int:
        """Check every row, append its start to `offsets`, add its label to `labels`; -> the end offset."""
        lines = _Lines(f, first=True)
        if self.format == "jsonl":
            keys = None
            while True:
                start = lines.offset
                line = next(lines, None)
                if line is None:
                    return lines.offset
                if not line.strip():
                    continue
                row = self._json_row(line, lines.number)
                if keys is None:
                    keys = list(row)
                    self._check_columns(keys)
                self._add([row.get(c) for c in self.columns], start, lines.number, len(row), offsets)
        reader = _reader(lines, self.format)
        self.header = next(reader, None)
        if self.header is None:
            return lines.offset  # an empty file: no rows
        self._check_columns(self.header)
        self.index = {name: i for i, name in enumerate(self.header)}
        self._where = [self.index[c] for c in self.columns]  # the columns' positions in a row
        while True:
            start = lines.offset
            fields = next(reader, None)
            if fields is None:
                return lines.offset
            if fields:  # not a blank line
                self._add(self._values(fields), start, reader.line_num, len(fields), offsets)

    def _check_columns(self, columns: list[str]) -> None:
        missing = [c for c in self.columns if c not in columns]
        if missing:
            flags = "--text-column / --label-column" + (" / --text-pair-column" if self.pair else "")
            raise ValueError(f"{self.path} has no column {', '.join(map(repr, missing))}; its columns are "
                             f"{', '.join(map(repr, columns))} (choose with {flags})")

    def _add(self, values: list, start: int, line: int, n_fields: int, offsets: array) -> None:
        # a TSV/CSV row with too few fields gives None (a class "None" otherwise); a JSONL row may lack the key
        label = _label(values[1]) if values[1] is not None else ""
        if not label or None in values:
            empty = [c for c, v in zip(self.columns, values) if v is None or (c == self.columns[1] and not label)]
            raise ValueError(f"{self.path}, line {line}: no {' and no '.join(map(repr, empty))} value "
                             f"({n_fields} field(s) in the row); fix or remove the row")
        self.labels.add(label, line)
        offsets.append(start)

    def _values(self, fields: list[str]) -> list:
        """The row's text, label (and pair) fields; None for those the row is too short to have."""
        return [fields[i] if i < len(fields) else None for i in self._where]

    def _json_row(self, line: str, number: int) -> dict:
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.path}, line {number}: not JSON ({e.msg} at column {e.colno}); each line "
                             "must be one JSON object") from None
        if not isinstance(row, dict):
            raise ValueError(f"{self.path}, line {number}: a JSON {type(row).__name__}, not an object of named "
                             "columns ({\"sentence\": ..., \"label\": ...})")
        return row

    # ------------------------------------------------------------------ rows, read again

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int):
        if self._pid != os.getpid():  # a forked DataLoader worker must not share the parent's file position
            self._file, self._pid = open(self.path, "rb"), os.getpid()
        self._file.seek(int(self.offsets[i]))
        lines = _Lines(self._file, first=self.offsets[i] == 0)
        if self.format == "jsonl":
            row = json.loads(next(lines))
            text, label, *pair = (row.get(c) for c in self.columns)
        else:
            text, label, *pair = self._values(next(_reader(lines, self.format)))
        text = str(text).strip()
        return ((text, str(pair[0]).strip()) if self.pair else text), _label(label)

    def row_bytes(self) -> np.ndarray:
        """Each row's size in the file (int64): a proxy of its length in tokens, for grouping by length."""
        return np.diff(self.offsets, append=self.end)

    def __getstate__(self):
        return {**self.__dict__, "_file": None, "_pid": None}  # open files do not travel to spawned workers

    def __del__(self):
        if getattr(self, "_file", None) is not None and self._pid == os.getpid():
            self._file.close()


def _label(value) -> str:
    """A raw label as text: JSON numbers as written, JSON lists as comma lists."""
    if isinstance(value, list):
        return ",".join(str(v).strip() for v in value)
    return str(value).strip()


def read_labelled_texts(path: str | Path, text_column: str, label_column: str, pair_column: str | None = None
                        ) -> tuple[list, list[str]]:
    """(texts, labels as strings) of a whole table, in memory: for files that fit (see `TextTable`)."""
    table = TextTable(path, text_column, label_column, pair_column)
    rows = [table[i] for i in range(len(table))]
    return [text for text, _ in rows], [label for _, label in rows]
