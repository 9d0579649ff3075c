"""Labelled text tables (.tsv, .csv, .jsonl with named columns) and what their label column asks for."""
from __future__ import annotations

import math
from pathlib import Path

__all__ = ["read_labelled_texts", "infer_problem", "regression_targets", "split_label_lists"]


def read_labelled_texts(path: str | Path, text_column: str, label_column: str, pair_column: str | None = None
                        ) -> tuple[list, list[str]]:
    """(texts, labels as strings) from a .tsv, .csv or .jsonl file with a header / keys naming the columns;
    with `pair_column` each text is a sentence pair (text, pair)."""
    import csv
    import json

    from zoo._io import existing
    path = existing(path, "file", "data file", "a .tsv, .csv or .jsonl file")
    suffix = path.suffix.lower()
    rows: list[tuple[int, dict]] = []  # (line number in the file, row)
    if suffix == ".jsonl":
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                rows.append((number, json.loads(line)))
    elif suffix in (".tsv", ".csv"):
        with open(path, newline="", encoding="utf-8") as f:
            # GLUE TSVs are unquoted; CSVs follow the usual quoting rules
            reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if suffix == ".tsv" else csv.DictReader(f)
            rows = [(reader.line_num, row) for row in reader]  # line_num: the row's last line (quoted CSVs span more)
    else:
        raise ValueError(f"{path}: unsupported data format {suffix!r}; use .tsv, .csv or .jsonl")
    if not rows:
        raise ValueError(f"{path} holds no examples")
    header = rows[0][1]
    columns = [text_column, label_column] + ([pair_column] if pair_column else [])
    missing = [c for c in columns if c not in header]
    if missing:
        raise ValueError(f"{path} has no column {', '.join(map(repr, missing))}; its columns are "
                         f"{', '.join(map(repr, header))} (choose with --text-column / --label-column"
                         f"{' / --text-pair-column' if pair_column else ''})")
    texts, labels = [], []
    for number, row in rows:
        # a TSV/CSV row with too few fields gives None (a class "None" otherwise); a JSONL row may lack the key
        values = [row.get(c) for c in columns]
        empty = [c for c, v in zip(columns, values)
                 if v is None or (c == label_column and str(v).strip() == "")]
        if empty:
            raise ValueError(f"{path}, line {number}: no {' and no '.join(map(repr, empty))} value "
                             f"({len([v for v in row.values() if v is not None])} field(s) in the row); "
                             "fix or remove the row")
        text = str(values[0]).strip()
        texts.append((text, str(values[2]).strip()) if pair_column else text)
        labels.append(str(values[1]).strip())
    return texts, labels


def infer_problem(labels: list[str], source: str = "the label column") -> str:
    """What a label column asks for: "multi_label" when labels are comma lists ("a,b"), "regression" when they
    are numbers and some are not whole ("0.5", "3.8"), else "single_label" (one class name or id per row).
    A column that mixes kinds is an error naming an example of each."""
    lists = [label for label in labels if "," in label]
    numbers, texts = [], []
    for label in labels:
        try:
            numbers.append((label, float(label)))
        except ValueError:
            texts.append(label)
    fractions = [label for label, v in numbers if not math.isfinite(v) or v != int(v)]
    if lists and fractions:
        raise ValueError(f"{source} mixes comma lists (multi-label, e.g. {lists[0]!r}) with fractional numbers "
                         f"(regression targets, e.g. {fractions[0]!r}); a column holds one kind of label, or "
                         "say which with --problem")
    if lists:
        return "multi_label"
    if fractions and texts:
        raise ValueError(f"{source} mixes fractional numbers (regression targets, e.g. {fractions[0]!r}) with "
                         f"text labels (classes, e.g. {texts[0]!r}); a column holds one kind of label, or say "
                         "which with --problem")
    return "regression" if fractions else "single_label"


def regression_targets(labels: list[str], source: str = "the label column") -> list[float]:
    """The labels as finite floats; an error names the first that is not."""
    values = []
    for i, label in enumerate(labels):
        try:
            value = float(label)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ValueError(f"{source}: label {i} ({label!r}) is not a finite number, as a regression target "
                             "must be")
        values.append(value)
    return values


def split_label_lists(labels: list[str]) -> list[list[str]]:
    """Multi-label rows "a,b" -> ["a", "b"] (spaces around names dropped, empty names ignored)."""
    return [sorted({name.strip() for name in label.split(",") if name.strip()}) for label in labels]
