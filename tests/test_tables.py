"""Labelled text tables read in one streaming pass and parsed again per row (issue 17 item 3): the rows are
those Python's own csv.DictReader / json give, in any order and from DataLoader workers; the label summary
says what a list of the same labels says."""
import csv
import json

import pytest
import torch

from zoo.data import tables
from zoo.data.tables import LabelSummary, TextTable, infer_problem

# quoted fields with commas, quotes and a line break; spaces to strip; a blank line; CRLF line ends
CSV_ROWS = [["a film, and a \"good\" one", " pos "], ["two\nlines", "neg"], ["é, ü and 漢字", "pos"], ["last", "neg"]]


def write_csv(path, rows, header=("sentence", "label"), bom=True):
    with open(path, "w", newline="", encoding="utf-8-sig" if bom else "utf-8") as f:
        writer = csv.writer(f, lineterminator="\r\n")
        writer.writerow(header)
        writer.writerows(rows[:2])
        f.write("\r\n")
        writer.writerows(rows[2:])
    return path


def test_csv_rows_are_those_of_csv_dictreader_in_any_order(tmp_path):
    path = write_csv(tmp_path / "t.csv", CSV_ROWS)
    with open(path, newline="", encoding="utf-8-sig") as f:
        want = [(row["sentence"].strip(), row["label"].strip()) for row in csv.DictReader(f)]
    table = TextTable(path, "sentence", "label")
    assert len(table) == 4 and [table[i] for i in (3, 1, 0, 2)] == [want[i] for i in (3, 1, 0, 2)]
    assert int(table.row_bytes().sum()) == path.stat().st_size - len("\ufeffsentence,label\r\n".encode())
    assert table.labels.classes("single_label") == {"pos", "neg"}


def test_rows_from_two_dataloader_workers_equal_the_rows_read_in_order(tmp_path):
    path = tmp_path / "t.tsv"
    path.write_text("q\ta\tlabel\n" + "".join(f"question {i}\tanswer {i}\t{i % 3}\n" for i in range(40)))
    table = TextTable(path, "q", "label", "a")
    table[0]  # the parent's open file must not be shared by the forked workers
    loader = torch.utils.data.DataLoader(table, batch_size=5, num_workers=2, collate_fn=list)
    assert [row for batch in loader for row in batch] == [((f"question {i}", f"answer {i}"), str(i % 3))
                                                          for i in range(40)]


def test_jsonl_numbers_lists_and_blank_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"text": "one", "label": 1}, {"text": "two", "label": 0.5}, {"text": 3, "label": ["b", "a"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    table = TextTable(path, "text", "label")
    assert [table[i] for i in range(len(table))] == [("one", "1"), ("two", "0.5"), ("3", "b,a")]
    path.write_text(path.read_text() + '{"text": "four"}\n')  # line 5: the blank line 3 counts
    with pytest.raises(ValueError, match=r"t.jsonl, line 5: no 'label' value"):
        TextTable(path, "text", "label")


def test_label_summary_of_train_and_eval_says_what_the_label_lists_say():
    train, dev = ["0", "1", "2"], ["1", "10"]
    both = LabelSummary.of(train, "train") | LabelSummary.of(dev, "dev")
    assert both.problem() == infer_problem(train + dev) == "single_label"
    assert both.classes("single_label") == {"0", "1", "2", "10"}
    multi = LabelSummary.of(["pos,fun", "neg", " dull , neg"])
    assert multi.problem() == "multi_label" and multi.classes("multi_label") == {"pos", "fun", "neg", "dull"}
    with pytest.raises(ValueError, match=r"label 1 \('nan'\) is not a finite number"):
        LabelSummary.of(["0.5", "nan"]).check_regression()
    with pytest.raises(ValueError, match="mixes fractional numbers .* with text labels"):
        (LabelSummary.of(["0.5"]) | LabelSummary.of(["pos"])).problem()


def test_distinct_labels_kept_are_bounded(monkeypatch):
    monkeypatch.setattr(tables, "MAX_DISTINCT_LABELS", 10)
    summary = LabelSummary.of([f"{i / 7:.4f}" for i in range(100)])
    assert summary.problem() == "regression" and len(summary.labels) <= 11
    summary.check_regression()
    with pytest.raises(ValueError, match="more than 10 distinct labels"):
        summary.classes("single_label")
