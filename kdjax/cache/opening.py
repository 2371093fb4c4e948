"""create() and open(): a store's zarr group on disk, its attributes checked, as a `Store`.

create() writes the group and its sealed attributes (attributes.py), or resumes the store already
there if its spec is the same; open() refuses a store that is missing, edited, built for another
vocabulary, k, seq_len or tokenizer than the caller expects, unfinished or damaged. Every refusal
is a CacheError that says what to do.
"""
import datetime
import os

from kdjax.cache import attributes, durable, integrity, layout as layout_lib
from kdjax.cache.errors import CacheError
from kdjax.cache.store import Store


def _default_region_rows(num_seqs, seq_len):
  # About 256K positions per region: a few tens of MB per shard at k = 100, so a lost region
  # costs seconds of teacher time and the manifest stays small for billions of positions.
  return int(max(1, min(num_seqs, 2**18 // seq_len)))


def _check_folder(path):
  """CacheError if `path` or a folder above it is a file (os.makedirs would fail obscurely)."""
  folder = os.path.abspath(path)
  while not os.path.exists(folder):
    folder = os.path.dirname(folder)
  if not os.path.isdir(folder):
    raise CacheError(f"{folder} is a file, so the store {path} cannot be "
                     f"{'that file' if folder == os.path.abspath(path) else 'under it'}: point "
                     f"the store's path (cache.path / the workdir) at a directory (it is created "
                     f"if missing).")


def _root_fix(path):
  return (f"The store's attributes are lost: restore the file (manifest/zarr.json keeps a copy of "
          f"them under \"{attributes.COPY}\"), or delete {path} and re-run the stage that writes "
          f"it.")


def _read_attrs(path):
  """The group's attributes, checked (attributes.check); CacheError if the file does not parse."""
  attrs = durable.read_json(os.path.join(path, "zarr.json"), _root_fix(path)).get("attributes")
  if not isinstance(attrs, dict):
    raise CacheError(f"{path}/zarr.json has no attributes. {_root_fix(path)}")
  if attrs.get("format_version") != layout_lib.FORMAT_VERSION:
    raise CacheError(f"{path} has format version {attrs.get('format_version')}, this code reads "
                     f"{layout_lib.FORMAT_VERSION}: rebuild the store.")
  manifest = os.path.join(path, "manifest", "zarr.json")
  manifest_attrs = {}
  if os.path.exists(manifest):
    manifest_attrs = durable.read_json(
        manifest, f"Delete it and re-run `python -m kdjax.cache verify {path}`."
    ).get("attributes", {})
  attributes.check(path, attrs, manifest_attrs)
  return attrs


def _write_group(path, attrs):
  os.makedirs(path, exist_ok=True)
  try:
    durable.write_json(os.path.join(path, "zarr.json"),
                       {"zarr_format": 3, "node_type": "group", "attributes": attrs},
                       exclusive=True)
  except FileExistsError:
    pass


def create(path, *, num_seqs, seq_len, k, vocab_size, attrs, layout="float32", region_rows=None,
           hidden_dim=0):
  """Creates a store, or resumes an existing one with the same spec.

  Args:
    path: directory of the store.
    num_seqs, seq_len: rows and positions per row.
    k: top-k entries per position (at most vocab_size); 0 for tokenised data without teacher
      outputs.
    vocab_size: ids must lie in [0, vocab_size).
    attrs: JSON-serialisable identity of the contents (teacher hash, tokenizer hash, data
      source); resuming with different attrs is refused.
    layout: "float32" (reference), "compact", "packed" or "dictionary" (see layout.py).
    region_rows: rows per region (the unit of writing and crash safety); default ~256K positions.
    hidden_dim: H > 0 also stores the teacher's final hidden states [S, T, H] (bf16, layout.py).
  Raises:
    CacheError: bad arguments (checked before anything is created), the path is a file, the path
      holds a store with a different spec or with edited attributes, or the disk is full.
  """
  path = os.fspath(path)
  region_rows = region_rows or _default_region_rows(num_seqs, seq_len)
  spec = attributes.spec(num_seqs, seq_len, k, vocab_size, dict(attrs), layout, region_rows,
                         hidden_dim)
  _check_folder(path)
  created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  with durable.disk_full_is_a_cache_error(path):
    _write_group(path, attributes.seal({**spec, "created": created}))
    existing = _read_attrs(path)
    if diff := attributes.differences(existing, spec):
      raise CacheError(f"{path} already holds a store with a different spec "
                       f"(key: stored vs requested): {diff}. Resume with the original parameters, "
                       f"or delete {path} to start over.")
    _write_group(os.path.join(path, "manifest"), {"description": "records of completed regions",
                                                  attributes.COPY: attributes.copy(existing)})
    return Store(path, existing, create=True)


def open(path, *, vocab_size=None, k=None, seq_len=None, tokenizer_hash=None, hidden=False,
         allow_partial=False):
  """Opens a store for reading after checking it is intact and matches what the caller expects.

  Args:
    path: directory of the store.
    vocab_size, k, seq_len, tokenizer_hash: expected values; None skips the check. A cache of
      more than k entries per position is read as its first k, which are the teacher's top k
      (entries are stored by descending probability): one k = 100 cache serves every k <= 100.
    hidden: the caller needs the teacher's hidden states (refuse a store without them).
    allow_partial: accept a store whose writer has not finished, and skip the check of the
      finished regions' files (to inspect or repair it).
  Raises:
    CacheError: no store, edited or unparsable attributes (attributes.py), a mismatch, or missing
      or damaged regions; the message says what to do.
  """
  path = os.fspath(path)
  if os.path.exists(path) and not os.path.isdir(path):
    _check_folder(path)
  if not os.path.exists(os.path.join(path, "zarr.json")):
    raise CacheError(f"no store at {path}: build it first (the data / teacher stage writes it).")
  attrs = _read_attrs(path)
  expected = {"vocab_size": vocab_size, "seq_len": seq_len, "tokenizer_hash": tokenizer_hash}
  for key, want in expected.items():
    if want is not None and attrs.get(key) != want:
      raise CacheError(f"{path} was built with {key}={attrs.get(key)!r} but {want!r} is expected: "
                       f"rebuild the store for this model/tokenizer, or point to the matching "
                       f"one.")
  if k is not None and k != attrs["k"] and not 0 < k <= attrs["k"]:
    raise CacheError(f"{path} holds the teacher's top {attrs['k']} entries per position but "
                     f"k={k} is asked for: set cache.k to at most {attrs['k']}, or rebuild the "
                     f"cache with cache.k={k} (another cache.path).")
  store = Store(path, attrs)
  if k is not None:
    store.read_k = k
  if hidden:
    store.require_hidden()
  if not allow_partial:
    if missing := store.missing_regions():
      raise CacheError(f"{path} is incomplete: {len(missing)} of {store.num_regions} regions are "
                       f"not written ({integrity.describe_regions(store, missing)}). Re-run the "
                       f"stage that writes it (the same command resumes where it stopped), or open "
                       f"with allow_partial=True to inspect it.")
    # Cheap (file sizes, no reading): a deleted or truncated shard would otherwise read as zeros.
    if problems := integrity.check_records(store):
      raise CacheError(f"{path} is damaged: {len(problems)} problems, first: {problems[0]}. Run "
                       f"`python -m kdjax.cache verify --fix {path}`, then re-run the stage that "
                       f"wrote it to rewrite the damaged regions.")
  return store
