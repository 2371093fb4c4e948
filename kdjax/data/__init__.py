"""The data stage: document sources, chat rendering, packing, and the k=0 stores they fill.

  sources.py   documents(source, ...): "stdlib" or .jsonl/.parquet, streamed
  chat.py      chat templates rendered as transformers does, with assistant spans
  packing.py   pack(token_docs, seq_len, bos_id=, eos_id=): greedy rows with segments
  stage.py     build(c.data, tok, ...): the stage; build_stores(...): its tokenise-pack-write core
"""
from kdjax.data.packing import Packer, pack
from kdjax.data.sources import DataError, Document, documents, stdlib_files
from kdjax.data.stage import build, build_stores, tokenize

__all__ = ["DataError", "Document", "Packer", "build", "build_stores", "documents", "pack",
           "stdlib_files", "tokenize"]
