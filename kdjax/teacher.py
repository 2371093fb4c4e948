"""Runs the teacher over a tokenised data store and writes its top-k log-probs to a cache; or,
with objective "online", beside training on each micro-batch (OnlineTargets).

Shape letters: B batch, T positions, D model width, V vocabulary, K top-k, C chunk of positions,
H width of the cached hidden states.

Optionally the teacher's final hidden states (after the final norm: what its lm_head reads) are
cached beside the top-k, in bf16, for the hidden-state loss term (kdjax.loss.hidden): whole
(H = D), or through a fixed random projection to H < D columns (hidden_projection_DxH), which
keeps inner products and distances on average while the cache stores H / D of the bytes.

The teacher's [B, T, V] logits never exist at once: positions are processed in chunks of C, each
projected through the lm_head in float32, normalised over the full vocabulary and reduced to its
top K before the next chunk. Work is done region by region (the cache's unit of crash safety), so a
killed run, started again, continues with the first unfinished region; ranks of a multi-process run
take disjoint regions, and a second writer of a rank already running is refused (its lock file); a
rank with nothing left to write returns at once, without the lock.
"""
import collections
import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from kdjax import cache, parallel
from kdjax.cache import events
from kdjax.cache.identity import data_attrs
from kdjax.data.packing import pad_rows
from kdjax.models import documents

_TOKEN_ARRAYS = ("tokens", "segment_ids", "positions", "loss_mask")
HIDDEN_PROJECTION_SEED = 0  # recorded in the cache's attributes with the projection


def hidden_projection_DxH(width, hidden_dim, seed=HIDDEN_PROJECTION_SEED):
  """The fixed random projection of cached hidden states [D, H]: N(0, 1/H) entries, so a
  projected vector keeps its squared norm on average (Johnson-Lindenstrauss)."""
  return jax.random.normal(jax.random.key(seed), (width, hidden_dim), jnp.float32) / np.sqrt(
      hidden_dim)


# Columns per block at each level of exact_top_k: V / 64 block maxima (2004 at V = 128256), then
# the k best blocks' k x 64 columns in blocks of 8, then those blocks' columns in blocks of 2:
# top_k calls over <= 2048 columns where one over the k x 64 candidates sorted 8192-wide (XLA's
# top_k for k > 16 sorts whole rows). experiments/bench/topk_bench.py measures the choices (ms
# per 4096-position chunk after the lm_head, two calls on the H200, 2026-12-04): at V = 128256
# 4.12-4.21 with (64,) and logsumexp, 1.77-1.83 with these levels, 1.64-1.88 with (128, 16, 2);
# at V = 201088 4.63-5.04, 2.41-2.47, 1.73-2.23; at V = 49152 2.78, 0.70, 1.09.
TOPK_BLOCKS = (64, 8, 2)


def _blocked(x_NxV, block):
  """x as [N, B, W] blocks of `block` columns, the last one padded with -inf."""
  rows, vocab = x_NxV.shape
  blocks = -(-vocab // block)
  return jnp.pad(x_NxV, ((0, 0), (0, blocks * block - vocab)),
                 constant_values=-jnp.inf).reshape(rows, blocks, block)


def _top_k_of_blocks(x_NxBxW, maxima_NxB, k, blocks):
  """exact_top_k given x's first level of blocks and their maxima."""
  rows, _, width = x_NxBxW.shape
  _, top_NxK = jax.lax.top_k(maxima_NxB, k)
  x_NxM = jnp.take_along_axis(x_NxBxW, top_NxK[..., None], axis=1).reshape(rows, k * width)
  ids_NxM = (top_NxK[..., None] * width + jnp.arange(width)[None, None]).reshape(rows, k * width)
  for block in blocks:  # the next levels, over the candidates (k * width columns: no padding)
    if k * width // block < 2 * k:
      break
    x_NxBxW = x_NxM.reshape(rows, -1, block)
    _, top_NxK = jax.lax.top_k(jnp.max(x_NxBxW, axis=-1), k)
    x_NxM = jnp.take_along_axis(x_NxBxW, top_NxK[..., None], axis=1).reshape(rows, k * block)
    cols_NxM = (top_NxK[..., None] * block + jnp.arange(block)[None, None]).reshape(
        rows, k * block)
    ids_NxM, width = jnp.take_along_axis(ids_NxM, cols_NxM, axis=1), block
  values_NxK, at_NxK = jax.lax.top_k(x_NxM, k)
  return values_NxK, jnp.take_along_axis(ids_NxM, at_NxK, axis=1)


def _levels(vocab, k, blocks):
  """The block widths exact_top_k uses at V: none when V has too few blocks to gain."""
  if any(wide % narrow for wide, narrow in zip(blocks, blocks[1:])):
    raise ValueError(f"top-k blocks {blocks}: each width must divide the one before it")
  return tuple(blocks) if blocks and -(-vocab // blocks[0]) >= 2 * k else ()


def exact_top_k(x_NxV, k: int, blocks=TOPK_BLOCKS):
  """jax.lax.top_k(x, k) over the last axis, in small top_k calls instead of one over V
  (XLA's top_k for k > 16 sorts whole rows: ~8x the lm_head matmul at V = 201,088 on an H200).
  Exact: the k blocks with the largest maxima hold at least k entries at or above the k-th of
  those maxima, so the k largest entries all lie in them; each level applies this to the previous
  level's k x W candidates. Ties may pick other ids of equal value. Returns (values [N, K],
  ids [N, K]) as top_k does."""
  levels = _levels(x_NxV.shape[-1], k, blocks)
  if not levels:
    return jax.lax.top_k(x_NxV, k)
  x_NxBxW = _blocked(x_NxV, levels[0])
  return _top_k_of_blocks(x_NxBxW, jnp.max(x_NxBxW, axis=-1), k, levels[1:])


def top_k_logprobs(logits_NxV, k: int, blocks=TOPK_BLOCKS):
  """The top k (log-softmax values [N, K], ids [N, K]) of float32 logits: exact_top_k, and the
  softmax's normaliser from its first level's blocks (each block's maximum and sum of
  exp(x - maximum)), so the logits are read once where logsumexp and the blocks read them three
  times."""
  levels = _levels(logits_NxV.shape[-1], k, blocks)
  if not levels:
    values_NxK, ids_NxK = jax.lax.top_k(logits_NxV, k)
    return values_NxK - jax.nn.logsumexp(logits_NxV, axis=-1)[:, None], ids_NxK
  x_NxBxW = _blocked(logits_NxV, levels[0])
  maxima_NxB = jnp.max(x_NxBxW, axis=-1)
  sums_NxB = jnp.sum(jnp.exp(x_NxBxW - maxima_NxB[..., None]), axis=-1)
  lse_N = jax.nn.logsumexp(maxima_NxB + jnp.log(sums_NxB), axis=-1)
  values_NxK, ids_NxK = _top_k_of_blocks(x_NxBxW, maxima_NxB, k, levels[1:])
  return values_NxK - lse_N[:, None], ids_NxK


def topk_logprobs(hidden_BxTxD, lm_head_DxV, *, k, chunk_size):
  """Top-k ids [B, T, K] int32 and their log-softmax over the full vocabulary [B, T, K] float32."""
  batch, seq_len, _ = hidden_BxTxD.shape
  chunk = min(chunk_size, seq_len)
  pad = -seq_len % chunk
  hidden_BxTxD = jnp.pad(hidden_BxTxD, ((0, 0), (0, pad), (0, 0)))
  # [T/C, B, C, D]: lax.map runs one chunk at a time, so one [B, C, V] block is live at a time.
  chunks_NxBxCxD = hidden_BxTxD.reshape(batch, -1, chunk, hidden_BxTxD.shape[-1]).swapaxes(0, 1)

  def one_chunk(hidden_BxCxD):
    # float32 logits: log-probs of the tail entries lose most of their digits in bf16.
    logits_BxCxV = jnp.einsum("bcd,dv->bcv", hidden_BxCxD, lm_head_DxV,
                              preferred_element_type=jnp.float32)
    b, c, v = logits_BxCxV.shape
    logprobs_NxK, ids_NxK = top_k_logprobs(logits_BxCxV.reshape(b * c, v), k)
    return ids_NxK.reshape(b, c, k).astype(jnp.int32), logprobs_NxK.reshape(b, c, k)

  ids_NxBxCxK, logprobs_NxBxCxK = jax.lax.map(one_chunk, chunks_NxBxCxD)
  unchunk = lambda x: x.swapaxes(0, 1).reshape(batch, -1, k)[:, :seq_len]
  return unchunk(ids_NxBxCxK), unchunk(logprobs_NxBxCxK)


@functools.partial(jax.jit, static_argnames=("graphdef", "k", "chunk_size", "vocab_size",
                                             "max_documents", "hidden"))
def topk_batch(graphdef, state, projection_DxH, tokens_BxT, positions_BxT, segment_ids_BxT, *,
               k, chunk_size, vocab_size, max_documents, hidden):
  """One batch's cache rows, as write_cache computes them: top-k ids and log-probs [B, T, K], and
  with `hidden` the final hidden states [B, T, H] in bf16 (projected when projection_DxH is not
  None), else None. graphdef, state: nnx.split(teacher); max_documents: see
  documents.documents_bound."""
  model = nnx.merge(graphdef, state)
  hidden_BxTxD = model(tokens_BxT, positions_BxT, segment_ids_BxT, max_documents)
  # Models may pad their vocabulary for speed; rows past the tokenizer's vocabulary are never
  # real tokens and must not take probability mass.
  lm_head_DxV = model.lm_head_DxV()[:, :vocab_size]
  ids_BxTxK, logprobs_BxTxK = topk_logprobs(hidden_BxTxD, lm_head_DxV, k=k, chunk_size=chunk_size)
  # Padding (segment 0) is never trained on and, in a row of padding only, may attend to nothing
  # (NaN): store a finite uniform placeholder there so the cache's NaN check guards real positions.
  pad_BxTx1 = (segment_ids_BxT == 0)[..., None]
  ids_BxTxK = jnp.where(pad_BxTx1, jnp.arange(k, dtype=jnp.int32), ids_BxTxK)
  logprobs_BxTxK = jnp.where(pad_BxTx1, -np.log(vocab_size).astype(np.float32), logprobs_BxTxK)
  if not hidden:
    return ids_BxTxK, logprobs_BxTxK, None
  if projection_DxH is not None:
    hidden_BxTxD = jnp.einsum("btd,dh->bth", hidden_BxTxD, projection_DxH.astype(
        hidden_BxTxD.dtype), preferred_element_type=jnp.float32)
  return ids_BxTxK, logprobs_BxTxK, jnp.where(pad_BxTx1, 0, hidden_BxTxD).astype(jnp.bfloat16)


class OnlineTargets:
  """The targets of objective "online": each micro-batch gets the teacher's final hidden states
  (its own jitted forward, run just before the student's grad_step, so the step never holds the
  teacher's activations with its own) and its lm_head [D, V] in the compute dtype, which the
  loss (kdjax.training.distillation) projects to the full-vocabulary log-probs chunk by chunk."""

  def __init__(self, model):
    self.graphdef, self.params = nnx.split(model)
    # Computed once, outside any program: the teacher is frozen, and an untied head already in
    # the compute dtype is then its parameter itself (a program's output would be a copy).
    self.head_DxV = model.lm_head_DxV()

  def __call__(self, micro_BxT: dict, max_documents: int) -> dict:
    """micro_BxT with teacher_hidden [B, T, D] and teacher_head [D, V] added."""
    hidden_BxTxD = _hidden_states(self.graphdef, self.params, micro_BxT["tokens"],
                                  micro_BxT["positions"], micro_BxT["segment_ids"],
                                  max_documents=max_documents)
    return {**micro_BxT, "teacher_hidden": hidden_BxTxD,
            "teacher_head": self.head_DxV.astype(hidden_BxTxD.dtype)}  # usually already is


@functools.partial(jax.jit, static_argnames=("graphdef", "max_documents"))
def _hidden_states(graphdef, state, tokens_BxT, positions_BxT, segment_ids_BxT, *, max_documents):
  return nnx.merge(graphdef, state)(tokens_BxT, positions_BxT, segment_ids_BxT, max_documents)


def write_cache(model, data_store, cache_path, *, k, batch_size, chunk_size, vocab_size, attrs,
                layout="float32", rank=0, world=1, region_rows=None, hidden_dim=0, mesh=None,
                writers=0, before_region=lambda: None, max_documents=None):
  """Writes (or resumes) the teacher cache of `data_store` at `cache_path`; returns the store.

  Args:
    model: teacher, `hidden = model(tokens, positions, segment_ids, max_documents)` (a static
      bound on the documents per row, see kdjax/models/attention.py), `model.lm_head_DxV()`.
    data_store: opened k = 0 store of tokenised rows.
    cache_path: directory of the cache; an unfinished cache with the same spec is resumed.
    k: top-k entries kept per position.
    batch_size: rows per teacher call; chunk_size: positions per lm_head projection.
    vocab_size: tokenizer vocabulary; the model's lm_head must have at least this many columns.
      k must lie in 1..vocab_size (checked before anything is created).
    attrs: cache identity (teacher hash, ...); the data store's attrs are added under "data".
    layout: "float32", "compact", "packed" or "dictionary" (see kdjax/cache/layout.py).
    rank, world: this process writes the regions r with r % world == rank.
    region_rows: rows per region; default the data store's.
    hidden_dim: 0, or also cache the final hidden states: H = the teacher's width D whole, else a
      fixed random projection to H columns (its seed in the cache's attributes).
    writers: threads encoding and writing finished regions while the device computes the next
      (0: min(8, CPU cores)).
    mesh: devices to shard the teacher over (kdjax/parallel.py: weights over fsdp, a batch's
      rows over the devices when they divide it), or None for one device. A mesh over several
      processes' devices (parallel.teacher_mesh("all")): every process calls this together and
      runs each batch, process 0 alone creates and writes the cache (rank, world as given).
    before_region: called before each region's work; it may raise to stop there (SIGTERM,
      kdjax.peers.Stop), the regions already computed being written first.
    max_documents: the static bound on segment ids of every batch (documents_bound of the rows
      to write, or of more: several passes then share one compiled step); default computed here.
  Raises:
    CacheError: bad k or vocabulary, another writer of this rank running, a store of another
      spec at cache_path, a full disk; the message says what to do.
  """
  width, model_vocab = jax.eval_shape(model.lm_head_DxV).shape
  if model_vocab < vocab_size:
    raise cache.CacheError(f"teacher lm_head has {model_vocab} columns, fewer than the "
                           f"vocabulary ({vocab_size}): wrong teacher or tokenizer.")
  if not 0 < k <= vocab_size:
    raise cache.CacheError(f"cache.k = {k} must lie in 1..{vocab_size}, the vocabulary size: the "
                           f"teacher has only {vocab_size} tokens to rank. Set --config.cache.k "
                           f"to at most {vocab_size}; nothing was written to {cache_path}.")
  attrs = {**attrs, "data": data_attrs(data_store)}
  projection_DxH = None
  if hidden_dim and hidden_dim != width:
    attrs["hidden_projection"] = {"from_width": width, "seed": HIDDEN_PROJECTION_SEED,
                                  "kind": "gaussian N(0, 1/H), kdjax.teacher"}
    projection_DxH = hidden_projection_DxH(width, hidden_dim)
  for key in ("tokenizer_hash", "source"):
    if key in data_store.attrs:
      attrs.setdefault(key, data_store.attrs[key])
  create = functools.partial(
      cache.create, cache_path, num_seqs=data_store.num_seqs, seq_len=data_store.seq_len, k=k,
      vocab_size=vocab_size, attrs=attrs, layout=layout,
      region_rows=region_rows or data_store.region_rows, hidden_dim=hidden_dim)
  run = functools.partial(_write_regions, data_store=data_store, model=model,
                          projection_DxH=projection_DxH, k=k, batch_size=batch_size,
                          chunk_size=chunk_size, vocab_size=vocab_size,
                          desc=f"teacher {rank}/{world}", mesh=mesh, writers=writers,
                          before_region=before_region, max_documents=max_documents)
  if parallel.spans_processes(mesh):  # one teacher over all processes: process 0 writes
    lead = jax.process_index() == 0
    if lead:
      create()
    parallel.barrier(f"{cache_path} created")
    store = create()  # the same spec: opens it (as writers of several ranks do)
    todo = store.missing(rank, world)
    parallel.barrier(f"{cache_path} read")  # everyone has the same regions to do
    if todo:
      with store.writer_lock(rank) if lead else contextlib.nullcontext():
        run(store, todo=todo, write=lead)
    parallel.barrier(f"{cache_path} written")
    return store
  store = create()
  if not store.missing(rank, world):  # complete: a reader, which any number may be at once
    store.remove_stale_lock(rank)  # a writer killed after its last record left it
    return store
  with store.writer_lock(rank):
    events.reached("locked")
    run(store, todo=store.missing(rank, world))
  return store


def _write_regions(store, *, data_store, todo, model, projection_DxH, k, batch_size, chunk_size,
                   vocab_size, desc, mesh, writers=0, write=True, before_region=lambda: None,
                   max_documents=None):
  """Computes and writes the rows of `todo` [(start, stop)], region by region (write False:
  computes only, another process of the teacher's mesh writes); writers: threads writing
  regions (0: min(8, cores))."""
  graphdef, state = nnx.split(model)
  place = lambda x: x  # host rows go to the default device
  if parallel.several(mesh):
    state = parallel.place_state(mesh, state)
    place = functools.partial(parallel.place_rows, mesh)
  in_flight = parallel.in_flight(mesh)
  step = functools.partial(topk_batch, graphdef, state, projection_DxH, k=k,
                           chunk_size=chunk_size, vocab_size=vocab_size,
                           hidden=store.hidden_dim > 0)
  total = sum(stop - start for start, stop in todo) * store.seq_len
  # Writer threads: regions are encoded, compressed and written (numpy and tensorstore release
  # the GIL) while the device computes the next ones; at most `writers` regions wait, which bounds
  # host memory. Regions are disjoint files and each is recorded complete only after its own
  # write, so a crash anywhere loses at most the regions in flight. The batches stream across
  # region boundaries and a reader thread fetches the next region's rows, so the device does
  # not wait for the host between two regions.
  writers = writers or min(8, os.cpu_count() or 1)
  names = [name for name in ("topk_ids", "topk_logprobs", "hidden") if name in store.dtypes]
  with (tqdm(total=total, unit="tok", unit_scale=True, desc=desc) as bar,
        concurrent.futures.ThreadPoolExecutor(writers, thread_name_prefix="cache-writer") as pool,
        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="cache-reader") as reader):
    pending = collections.deque()  # regions being written
    dispatched = collections.deque()  # (region, lo, outputs) not yet read back

    def collect():
      region, lo, outputs = dispatched.popleft()
      # The step's outputs in order; its hidden states (None unless cached) only when stored.
      for part, x in zip(region["parts"], parallel.gather(outputs[:len(names)])):
        part.append(np.asarray(x))
      rows = min(lo + batch_size, region["stop"] - region["start"]) - lo
      bar.update(rows * store.seq_len)
      events.reached("batch")
      region["left"] -= 1
      if not region["left"]:  # every batch read back: the region goes to a writer
        out = {name: region["rows"][name] for name in _TOKEN_ARRAYS}
        out.update({name: np.concatenate(part)[:region["stop"] - region["start"]]
                    for name, part in zip(names, region["parts"])})
        while len(pending) >= writers:
          pending.popleft().result()
        if write:
          pending.append(pool.submit(store.write, region["start"], out))

    read = lambda i: reader.submit(data_store.read, slice(*todo[i])) if i < len(todo) else None
    next_rows = read(0)
    bound = max_documents or documents.store_documents_bound(data_store, todo)
    started = time.perf_counter()
    for i, (start, stop) in enumerate(todo):
      try:
        before_region()  # may raise (a stop)
      except BaseException:
        while dispatched:  # the regions already computed are written first
          collect()
        raise
      rows = next_rows.result()
      next_rows = read(i + 1)
      region = {"start": start, "stop": stop, "rows": rows, "parts": [[] for _ in names],
                "left": -(-(stop - start) // batch_size)}
      # At most `in_flight` batches dispatched and not yet read (parallel.in_flight: on CPU
      # devices more deadlock in XLA's collectives; on a GPU they also bound its memory).
      for lo in range(0, stop - start, batch_size):
        dispatched.append((region, lo, step(*(place(pad_rows(rows[name][lo:lo + batch_size],
                                                               batch_size))
                                              for name in ("tokens", "positions", "segment_ids")),
                                            max_documents=bound)))
        if len(dispatched) >= in_flight:
          collect()
    while dispatched:
      collect()
    computed = time.perf_counter()
    while pending:
      pending.popleft().result()
    done = time.perf_counter()
    logging.info("%s: %d positions in %.1f s (%.0f/s; the first batch's compile included); the "
                 "last regions' writes took %.2f s after the last batch", desc, total,
                 done - started, total / max(done - started, 1e-9), done - computed)


def weights_hash(root: str) -> str:
  """Identity of a teacher's weights without reading them, for the cache's `teacher_hash`:
  config.json plus every weight file's name, size and header (safetensors), or every file of
  the final checkpoint (a teacher trained here) under `root`."""
  digest = hashlib.sha256()
  for folder, dirs, files in sorted(os.walk(root)):
    dirs.sort()
    for name in sorted(files):
      path = os.path.join(folder, name)
      digest.update(f"{os.path.relpath(path, root)}:{os.path.getsize(path)}".encode())
      if name == "config.json" or name.endswith(".safetensors"):
        with open(path, "rb") as f:
          head = f.read(8)
          # config.json whole; a safetensors file's JSON header (names, shapes, offsets)
          size = int.from_bytes(head, "little") if name.endswith(".safetensors") else -1
          digest.update(head + f.read(size))
  return digest.hexdigest()
