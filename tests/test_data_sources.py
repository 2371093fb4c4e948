"""Document sources: stdlib corpus, jsonl and parquet records, streaming, errors."""
import collections
import inspect
import itertools
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kdjax.data import sources

CHAT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def test_stdlib_is_deterministic_and_capped():
  files = sources.stdlib_files()
  assert files == sorted(files, key=lambda f: os.path.relpath(f, os.path.dirname(files[0])))
  assert not any(f"{os.sep}{d}{os.sep}" in f for f in files for d in ("test", "idlelib",
                                                                         "site-packages"))
  assert any(f.endswith(f"{os.sep}json{os.sep}decoder.py") for f in files)
  counts = collections.Counter()
  docs = list(sources.documents("stdlib", max_bytes=100_000, counts=counts))
  assert 100_000 <= counts["bytes"] < 100_000 + len(docs[-1].text.encode())
  assert counts["docs"] == len(docs)
  again = list(sources.documents("stdlib", max_bytes=100_000))
  assert [d.text for d in docs] == [d.text for d in again]
  assert all(d.spans is None and not d.templated for d in docs)


def test_documents_is_a_lazy_generator(tmp_path):
  path = tmp_path / "a.jsonl"
  path.write_text('{"text": "one"}\n{"text": "two"}\nnot json\n')
  docs = sources.documents(str(path))
  assert inspect.isgenerator(docs)
  # Streaming: the bad third line is not read before the first two documents are used.
  assert [d.text for d in itertools.islice(docs, 2)] == ["one", "two"]
  with pytest.raises(sources.DataError, match="line 3: invalid JSON"):
    next(docs)


def test_jsonl_text_chat_empty_and_counts(tmp_path):
  path = tmp_path / "mixed.jsonl"
  records = [{"text": "plain"}, {"text": ""}, {"text": "   \n"}, {"text": None},
             {"messages": [{"role": "user", "content": "hi"}]}, {"messages": []},
             {"text": "last", "extra": 1}]
  path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
  counts = collections.Counter()
  docs = list(sources.documents(str(path), chat_template=CHAT, counts=counts))
  assert [d.text for d in docs] == ["plain", "<user>hi", "last"]
  assert docs[1].templated and not docs[0].templated
  assert counts["empty"] == 4 and counts["docs"] == 3


def test_parquet_text_and_messages(tmp_path):
  pq.write_table(pa.table({"text": ["a", "", "b" * 10]}), tmp_path / "t.parquet")
  messages = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "ans"}]] * 3
  pq.write_table(pa.table({"messages": messages, "id": [1, 2, 3]}), tmp_path / "m.parquet")
  counts = collections.Counter()
  docs = list(sources.documents(str(tmp_path / "t.parquet"), counts=counts))
  assert [d.text for d in docs] == ["a", "b" * 10] and counts["empty"] == 1
  (doc, *_) = sources.documents(str(tmp_path / "m.parquet"), chat_template=CHAT,
                                loss_mask="assistant")
  assert doc.text == "<user>q<assistant>ans"
  assert [doc.text[a:b] for a, b in doc.spans] == ["<assistant>ans"]


def test_globs_commas_and_order(tmp_path):
  for name, text in (("b.jsonl", "B"), ("a.jsonl", "A")):
    (tmp_path / name).write_text(json.dumps({"text": text}) + "\n")
  pq.write_table(pa.table({"text": ["P"]}), tmp_path / "c.parquet")
  source = f"{tmp_path}/*.jsonl, {tmp_path}/c.parquet"
  assert [d.text for d in sources.documents(source)] == ["A", "B", "P"]


def test_missing_field_and_bad_paths(tmp_path):
  path = tmp_path / "x.jsonl"
  path.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
  with pytest.raises(sources.DataError, match=r"line 2 \(document 1\): missing field 'text'"):
    list(sources.documents(str(path)))
  with pytest.raises(sources.DataError, match=r"line 1 \(document 0\).*fields are \['text'\]"):
    list(sources.documents(str(path), text_field="body"))
  pq.write_table(pa.table({"body": ["x"]}), tmp_path / "x.parquet")
  with pytest.raises(sources.DataError, match="no column 'text'"):
    list(sources.documents(str(tmp_path / "x.parquet")))
  with pytest.raises(sources.DataError, match="no such file"):
    list(sources.documents(str(tmp_path / "nope.jsonl")))
  with pytest.raises(sources.DataError, match="no file matches"):
    list(sources.documents(str(tmp_path / "*.nothing")))
  with pytest.raises(sources.DataError, match="unknown format"):
    (tmp_path / "x.csv").write_text("text\n")
    list(sources.documents(str(tmp_path / "x.csv")))
  with pytest.raises(sources.DataError, match="loss_mask"):
    list(sources.documents("stdlib", loss_mask="assistants"))


def test_non_utf8_jsonl_names_file_line_and_offset(tmp_path):
  path = tmp_path / "latin1.jsonl"
  path.write_bytes(b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n')
  docs = sources.documents(str(path))
  assert next(docs).text == "ok"
  # Byte 29: 15 bytes of line 1, 1 of the empty line 2, 13 of line 3 before the latin-1 byte.
  with pytest.raises(sources.DataError,
                     match=re.escape(f"{path}: line 3: byte offset 29 is not UTF-8")) as e:
    next(docs)
  assert "must be UTF-8 encoded" in str(e.value)
