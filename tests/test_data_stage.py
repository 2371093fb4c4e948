"""The data stage end to end: source -> tokenizer -> packed k=0 stores, skip and resume."""
import json

import ml_collections
import numpy as np
import pytest

from kdjax import cache, tokenizer
from kdjax.data import sources, stage


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  texts = [d.text for d in sources.documents("stdlib", max_bytes=100_000)]
  return tokenizer.train_bpe(texts, 320, str(tmp_path_factory.mktemp("t") / "tokenizer.json"))


def write_jsonl(path, n):
  path.write_text("".join(json.dumps({"text": f"document {i}: " + "word " * (i % 7)}) + "\n"
                          for i in range(n)) + json.dumps({"text": ""}) + "\n")
  return str(path)


def test_build_stores_split_contents_and_skip(tok, tmp_path):
  source = write_jsonl(tmp_path / "d.jsonl", 30)
  train, eval_ = str(tmp_path / "train.zarr"), str(tmp_path / "eval.zarr")
  counts = stage.build_stores(source, tok, 16, train, eval_, eval_every=5)
  assert counts["docs"] == 30 and counts["empty"] == 1
  h = tokenizer.tokenizer_hash(tok)
  stores = [cache.open(p, k=0, seq_len=16, tokenizer_hash=h, vocab_size=320)
            for p in (train, eval_)]
  assert [s.num_seqs for s in stores] == [counts["train_rows"], counts["eval_rows"]]
  assert stores[1].attrs["split"] == "eval" and stores[0].attrs["source"] == source
  # Eval holds documents 0, 5, 10, ... (every 5th); train the others, in order.
  for store, wanted in zip(stores, ([i for i in range(30) if i % 5], range(0, 30, 5))):
    rows = store.read(slice(0, store.num_seqs))
    assert rows["tokens"].dtype == np.int32 and rows["loss_mask"].dtype == np.bool_
    texts = []
    for r in range(store.num_seqs):
      for s in range(1, rows["segment_ids"][r].max() + 1):
        texts.append(tok.decode(rows["tokens"][r][rows["segment_ids"][r] == s]))
    joined = "".join(texts)
    expected = "".join(f"<|bos|>document {i}: " + "word " * (i % 7) + "<|eos|>" for i in wanted)
    assert joined == expected
  # Complete stores are not rebuilt.
  assert stage.build_stores(source, tok, 16, train, eval_, eval_every=5) == {}
  with pytest.raises(sources.DataError, match="other data"):
    stage.build_stores(source, tok, 16, train, eval_, eval_every=4)


def test_interrupted_build_resumes(tok, tmp_path):
  source = write_jsonl(tmp_path / "d.jsonl", 40)
  train, eval_ = str(tmp_path / "train.zarr"), str(tmp_path / "eval.zarr")
  stage.build_stores(source, tok, 8, train, eval_, eval_every=3)
  reference = cache.open(train).read(slice(0, None))
  # Forget the regions' completion records, as after a crash: the stores become incomplete.
  store = cache.open(train)
  for region in range(store.num_regions):
    (tmp_path / "train.zarr" / "manifest" / store.region_record_path(region).split("/")[-1]
     ).unlink(missing_ok=True)
  with pytest.raises(cache.CacheError, match="incomplete"):
    cache.open(train)
  assert stage.build_stores(source, tok, 8, train, eval_, eval_every=3)["train_rows"] > 0
  again = cache.open(train).read(slice(0, None))
  for name in reference:
    np.testing.assert_array_equal(again[name], reference[name])


def test_empty_split_is_an_error_and_leaves_nothing(tok, tmp_path):
  source = write_jsonl(tmp_path / "d.jsonl", 1)
  with pytest.raises(sources.DataError, match="train split is empty"):
    stage.build_stores(source, tok, 16, str(tmp_path / "a"), str(tmp_path / "b"), eval_every=5)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]


def test_build_from_config_trains_tokenizer_on_stdlib(tmp_path):
  c = ml_collections.ConfigDict(dict(
      source="stdlib", text_field="text", messages_field="messages", loss_mask="all",
      max_bytes=60_000, seq_len=32, eval_every=10, eval_source="", tokenizer="", vocab_size=300))
  paths = dict(tokenizer_path=str(tmp_path / "data" / "tokenizer.json"),
               train_path=str(tmp_path / "data" / "train.zarr"),
               eval_path=str(tmp_path / "data" / "eval.zarr"))
  stage.build(c, None, **paths)
  tok = tokenizer.load(paths["tokenizer_path"])
  assert tokenizer.real_vocab_size(tok) == 300
  train = cache.open(paths["train_path"], k=0, seq_len=32,
                     tokenizer_hash=tokenizer.tokenizer_hash(tok))
  rows = train.read(slice(0, 4))
  assert rows["tokens"][0, 0] == tok.bos_id and rows["loss_mask"].any()
  assert (rows["segment_ids"] != 0).mean() > 0.9  # code files are long: little padding
  stage.build(c, tok, **paths)  # complete: skipped, tokenizer kept
  assert tokenizer.tokenizer_hash(tokenizer.load(paths["tokenizer_path"])) == \
      tokenizer.tokenizer_hash(tok)


def test_documents_separated_by_end_of_text_not_chat_markers(smollm2_tokenizer, tmp_path):
  """SmolLM2-Instruct's bos/eos (<|im_start|>/<|im_end|>) are chat markers: each plain-text
  document is followed by <|endoftext|> alone."""
  tok = tokenizer.load(smollm2_tokenizer(tmp_path / "smollm2"))
  source = write_jsonl(tmp_path / "d.jsonl", 6)
  train, eval_ = str(tmp_path / "train.zarr"), str(tmp_path / "eval.zarr")
  stage.build_stores(source, tok, 16, train, eval_, eval_every=3)
  store = cache.open(train)
  assert store.attrs["document_bos"] is None and store.attrs["document_eos"] == "<|endoftext|>"
  rows = store.read(slice(0, store.num_seqs))
  texts = [tok.decode(rows["tokens"][r][rows["segment_ids"][r] == s])
           for r in range(store.num_seqs) for s in range(1, rows["segment_ids"][r].max() + 1)]
  expected = "".join(f"document {i}: " + "word " * (i % 7) + "<|endoftext|>"
                     for i in range(6) if i % 3)
  assert "".join(texts) == expected


def test_eval_source_holds_the_eval_store(tok, tmp_path):
  """data.eval_source: every document of the source is trained on, the eval store holds the
  held-out file's; the stores record it, so another eval source is refused, not mixed."""
  source = write_jsonl(tmp_path / "d.jsonl", 7)
  held_out = tmp_path / "held_out.jsonl"
  held_out.write_text("".join(json.dumps({"text": f"held out {i}"}) + "\n" for i in range(3)))
  train, eval_ = str(tmp_path / "train.zarr"), str(tmp_path / "eval.zarr")
  counts = stage.build_stores(source, tok, 16, train, eval_, eval_every=5,
                              eval_source=str(held_out), max_bytes=20)
  assert counts["docs"] == 2 + 3  # max_bytes caps the source only: its first 2 documents

  def texts(path):
    store = cache.open(path)
    assert store.attrs["eval_source"] == str(held_out)
    rows = store.read(slice(0, store.num_seqs))
    return "".join(tok.decode(rows["tokens"][r][rows["segment_ids"][r] == s])
                   for r in range(store.num_seqs)
                   for s in range(1, rows["segment_ids"][r].max() + 1))
  assert texts(train) == "".join(f"<|bos|>document {i}: " + "word " * (i % 7) + "<|eos|>"
                                 for i in range(2))
  assert texts(eval_) == "".join(f"<|bos|>held out {i}<|eos|>" for i in range(3))
  with pytest.raises(sources.DataError, match="eval_source"):
    stage.build_stores(source, tok, 16, train, eval_, eval_every=5, max_bytes=20)


def test_pre_tokenised_records_are_packed_as_given(tok, tmp_path):
  """input_ids records: no bos/eos added, loss_mask picks the targets; mixed with text records;
  bad ids and masks are one-line errors naming the record."""
  docs = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}, {"text": "document one"},
          {"input_ids": [9, 10, 11]}, {"input_ids": []}]
  source = tmp_path / "ids.jsonl"
  source.write_text("".join(json.dumps(d) + "\n" for d in docs))
  train, eval_ = str(tmp_path / "train.zarr"), str(tmp_path / "eval.zarr")
  counts = stage.build_stores(str(source), tok, 32, train, eval_, eval_every=100)
  assert counts["docs"] == 3 and counts["empty"] == 1
  row = {k: v[0] for k, v in cache.open(eval_).read(slice(0, 1)).items()}
  seg1 = row["segment_ids"] == 1
  assert row["tokens"][seg1].tolist() == [5, 6, 7, 8]
  # loss_mask[t] says whether token t + 1 is a target: ids 7 and 8 only.
  assert row["loss_mask"][seg1].tolist() == [False, True, True, False]
  rows = cache.open(train).read(slice(0, 1))
  segs = rows["segment_ids"][0]
  assert tok.decode(rows["tokens"][0][segs == 1]) == "<|bos|>document one<|eos|>"
  assert rows["tokens"][0][segs == 2].tolist() == [9, 10, 11]
  assert rows["loss_mask"][0][segs == 2].tolist() == [True, True, False]
  for bad, match in (({"input_ids": [1, 2], "loss_mask": [1]}, "one per id"),
                     ({"input_ids": ["a"]}, "list of ints"),
                     ({"input_ids": [1, -2]}, "token ids are >= 0"),
                     ({"input_ids": [1, 100_000]}, "tokenizer has 320 ids")):
    source.write_text(json.dumps(bad) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(sources.DataError, match=match):
      stage.build_stores(str(source), tok, 32, str(tmp_path / "t2"), str(tmp_path / "e2"),
                         eval_every=100)


def test_pre_tokenised_records_need_a_tokenizer(tmp_path):
  source = tmp_path / "ids.jsonl"
  source.write_text(2 * (json.dumps({"input_ids": [1, 2, 3]}) + "\n"))
  c = ml_collections.ConfigDict(dict(source=str(source), text_field="text",
                                     messages_field="messages", max_bytes=0, eval_source="",
                                     eval_every=2, vocab_size=300, tokenizer="", seq_len=8,
                                     loss_mask="all"))
  with pytest.raises(sources.DataError, match="need the tokenizer"):
    stage.build(c, None, tokenizer_path=str(tmp_path / "tok.json"),
                train_path=str(tmp_path / "t"), eval_path=str(tmp_path / "e"))
