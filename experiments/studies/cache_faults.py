"""Fault injection on teacher caches: is each fault detected, what does it cost, is the repaired
cache byte-identical to one written without faults?

    JAX_PLATFORMS=cpu python -m experiments.studies.cache_faults [--trials 40] [--seed 0] \
        [--layouts compact,packed]

Per layout: writes a small data store and a reference cache with a stand-in teacher (two matrices: a
process starts in seconds; the cache logic does not depend on the model) in a temporary folder.
Then, per fault (kill -9 `--trials` times, the others half as often, a second writer an eighth):
inject it, check what the user sees (cache.open, `python -m kdjax.cache verify`), repair it the
documented way, compare every file with the reference.
  kill -9          a writer subprocess SIGKILLs itself at the n-th hit of a random failpoint
                   (tests/fixtures/failpoints.py); repair: run the writer again
  flipped byte     in a random shard of a finished cache; repair: verify --fix, run the writer again
  truncated shard  likewise, cut to a random length
  deleted shard    likewise
  edited attribute one of vocab_size, k, layout, logprob_scale, tokenizer_hash, teacher_hash,
                   region_rows; repair: undo the edit
  truncated zarr.json  the store's attributes; repair: rewrite it from manifest/zarr.json's copy
  disk full        tensorstore's RESOURCE_EXHAUSTED at a random region's shard write; repair: run
                   the writer again
  second writer    a writer of a rank whose writer is running (paused at a failpoint)
detected: the fault was reported (open/verify/the writer refused, naming it) and a cache that was
still whole was accepted. positions lost: positions written to disk then discarded (shards of
unrecorded regions, regions --fix deleted), mean per trial. Runs in about 3 minutes per layout on
2 CPU cores.
"""
import argparse
import concurrent.futures
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np

from kdjax import cache, teacher
from kdjax.cache import __main__ as cli, attributes
from tests.fixtures import failpoints
from tests.fixtures.stand_in import StandIn  # its defaults: V = 64, D = 16

V, D, T, K, ROWS, REGION_ROWS = 64, 16, 16, 8, 48, 2
REGIONS = ROWS // REGION_ROWS
POINTS = ("locked", "batch", "before_data", "data", "after_data", "after_record")
ATTRIBUTES = {"vocab_size": V - 4, "k": K - 1, "layout": "float32", "logprob_scale": 2.0**-10,
              "tokenizer_hash": "other", "teacher_hash": "other", "region_rows": 3}


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
layout = "compact"  # of the caches written; main() sets it per table


def write(data_path, cache_path, rank=0, world=1):
  with contextlib.redirect_stderr(io.StringIO()):  # progress bars
    teacher.write_cache(StandIn(), cache.open(data_path), cache_path, k=K, batch_size=2,
                        chunk_size=8, vocab_size=V, attrs={"teacher_hash": "stand-in"},
                        layout=layout, rank=rank, world=world)


def make_data(path):
  rng = np.random.default_rng(0)
  store = cache.create(path, num_seqs=ROWS, seq_len=T, k=0, vocab_size=V,
                       attrs={"tokenizer_hash": "tok", "source": "synthetic"},
                       region_rows=REGION_ROWS)
  store.write(0, {"tokens": rng.integers(0, V, (ROWS, T), dtype=np.int32),
                  "segment_ids": np.ones((ROWS, T), np.int32),
                  "positions": np.tile(np.arange(T, dtype=np.int32), (ROWS, 1)),
                  "loss_mask": np.ones((ROWS, T), bool)})


def files(path):
  """{relative path: bytes} of a store but its root zarr.json (its creation time differs)."""
  out = {}
  for root, _, names in os.walk(path):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), path)
      if rel != "zarr.json":
        with open(os.path.join(root, name), "rb") as f:
          out[rel] = f.read()
  return out


def run_cli(*args):
  """(exit status, stdout + stderr) of `python -m kdjax.cache ARGS`, in process."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
    status = cli.main(list(args))
  return status, out.getvalue()


def opens(path):
  """None if cache.open accepts the store, else its error message."""
  try:
    cache.open(path)
    return None
  except cache.CacheError as e:
    return str(e)


def unrecorded_positions(path):
  """Positions of regions with shard data on disk but no record: written, then discarded."""
  store = cache.open(path, allow_partial=True)
  lost = [r for r in store.missing_regions()
          if any(os.path.exists(store.shard_path(name, r)) for name in store.dtypes)]
  return sum(np.subtract(*store.region_bounds(r)[::-1]) for r in lost) * T


def spawn(data, path, failpoint, rank=0):
  # The child imports this checkout's kdjax (not another one installed in the environment).
  env = {**os.environ, "JAX_PLATFORMS": "cpu", failpoints.ENV: failpoint,
         "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
  return subprocess.Popen([sys.executable, __file__, "--child", data, path, str(rank), layout],
                          env=env,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def kill_trials(work, trials, rng, reference):
  """Each: a writer subprocess killed at a random point, then resumed in process."""
  plans = []
  for i in range(trials):
    point = POINTS[i % len(POINTS)]
    count = 1 if point == "locked" else int(rng.integers(1, REGIONS + 1))
    plans.append((f"{work}/kill{i}", point, count))

  def run(plan):
    path, point, count = plan
    proc = spawn(f"{work}/data", path, f"{point}:{count}:kill")
    out, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, (plan, err[-2000:])

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    list(pool.map(run, plans))
  rows = []
  for path, point, count in plans:
    # Whole when every region was recorded before the kill: the plan's last record, or (regions
    # are written by several threads) another thread's records landing before the kill did.
    finished = not cache.open(path, allow_partial=True).missing_regions()
    error = opens(path)
    status, _ = run_cli("verify", path)
    if finished:
      detected = error is None and status == 0
    else:
      detected = error is not None and "incomplete" in error and status == 1
    lost = unrecorded_positions(path)
    write(f"{work}/data", path)
    rows.append((detected, lost, files(path) == reference))
  return rows


def damage_trials(work, trials, rng, reference, damage):
  """Each: a finished cache damaged in one random shard, verify --fix, the writer run again."""
  rows = []
  for i in range(trials):
    path = f"{work}/{damage.__name__}{i}"
    shutil.copytree(f"{work}/reference", path)
    store = cache.open(path)
    region = int(rng.integers(REGIONS))
    shard = store.shard_path(sorted(store.dtypes)[rng.integers(len(store.dtypes))], region)
    damage(shard, rng)
    status, out = run_cli("verify", path)
    detected = status == 1 and f"DAMAGED region {region} " in out
    fixed, _ = run_cli("verify", "--fix", path)
    deleted = REGIONS - len(cache.open(path, allow_partial=True).complete_regions())
    lost = deleted * REGION_ROWS * T
    write(f"{work}/data", path)
    rows.append((detected and fixed == 1, lost, files(path) == reference))
  return rows


def flipped_byte(shard, rng):
  with open(shard, "r+b") as f:
    offset = int(rng.integers(os.path.getsize(shard)))
    f.seek(offset)
    byte = f.read(1)[0]
    f.seek(offset)
    f.write(bytes([byte ^ (1 << int(rng.integers(8)))]))


def truncated_shard(shard, rng):
  with open(shard, "r+b") as f:
    f.truncate(int(rng.integers(os.path.getsize(shard))))


def deleted_shard(shard, rng):
  os.unlink(shard)


def attribute_trials(work, trials, rng, reference):
  """Each: an attribute edited; open and verify --fix must refuse and change nothing."""
  rows = []
  keys = sorted(ATTRIBUTES)
  for i in range(trials):
    path = f"{work}/attr{i}"
    shutil.copytree(f"{work}/reference", path)
    key = keys[i % len(keys)]
    meta = os.path.join(path, "zarr.json")
    with open(meta) as f:
      original = f.read()
    obj = json.loads(original)
    obj["attributes"][key] = ATTRIBUTES[key]
    with open(meta, "w") as f:
      json.dump(obj, f)
    before = files(path)
    error = opens(path)
    status, out = run_cli("verify", "--fix", path)
    detected = (error is not None and "checksum" in error and key in error and status == 2
                and files(path) == before)
    with open(meta, "w") as f:
      f.write(original)
    rows.append((detected, 0, files(path) == reference and opens(path) is None))
  return rows


def truncated_root_trials(work, trials, rng, reference):
  """Each: zarr.json cut short; open names it; rewritten from the manifest's copy, it opens."""
  rows = []
  for i in range(trials):
    path = f"{work}/root{i}"
    shutil.copytree(f"{work}/reference", path)
    meta = os.path.join(path, "zarr.json")
    with open(meta, "r+b") as f:
      f.truncate(int(rng.integers(os.path.getsize(meta))))
    error = opens(path)
    detected = error is not None and f"{meta} is not valid JSON" in error
    with open(os.path.join(path, "manifest", "zarr.json")) as f:
      copy = json.load(f)["attributes"][attributes.COPY]
    with open(meta, "w") as f:
      json.dump({"zarr_format": 3, "node_type": "group", "attributes": copy}, f)
    rows.append((detected, 0, files(path) == reference and opens(path) is None))
  return rows


def disk_full_trials(work, trials, rng, reference):
  """Each: the shard write of a random region fails as on a full disk; the writer runs again."""
  rows = []
  for i in range(trials):
    path = f"{work}/full{i}"

    def full():
      raise ValueError(f'RESOURCE_EXHAUSTED: Error writing local file "{path}/topk_ids/c/0/0/0": '
                       f"No space left on device [os_error_code='28']")

    failpoints.arm("data", full, int(rng.integers(1, REGIONS + 1)))
    try:
      write(f"{work}/data", path)
      detected = False
    except cache.CacheError as e:
      detected = "no space left" in str(e) and "re-run the same command" in str(e)
    failpoints.disarm()
    lost = unrecorded_positions(path)
    write(f"{work}/data", path)
    rows.append((detected, lost, files(path) == reference))
  return rows


def second_writer_trials(work, trials, rng, reference):
  """Each: a writer paused holding its rank's lock; a second one of that rank must be refused."""
  rows = []
  for i in range(trials):
    path = f"{work}/twice{i}"
    first = spawn(f"{work}/data", path, "locked:1:pause")
    assert first.stdout.readline().strip() == "failpoint locked"
    second = spawn(f"{work}/data", path, "")
    _, err = second.communicate()
    detected = second.returncode == 1 and f"is held by pid {first.pid}" in err
    first.communicate("go\n")
    rows.append((detected and first.returncode == 0, 0, files(path) == reference))
  return rows


def faults(trials, rng):
  """{fault: [(detected, positions lost, byte-identical after repair)]} for caches of `layout`."""
  work = tempfile.mkdtemp(prefix="cache_faults_")
  try:
    make_data(f"{work}/data")
    write(f"{work}/data", f"{work}/reference")
    ref = files(f"{work}/reference")
    few = max(trials // 2, 1)
    return {
        "kill -9 at a random failpoint": kill_trials(work, trials, rng, ref),
        "flipped byte in a shard": damage_trials(work, few, rng, ref, flipped_byte),
        "truncated shard": damage_trials(work, few, rng, ref, truncated_shard),
        "deleted shard": damage_trials(work, few, rng, ref, deleted_shard),
        "edited attribute": attribute_trials(work, few, rng, ref),
        "truncated zarr.json": truncated_root_trials(work, few, rng, ref),
        "disk full (injected)": disk_full_trials(work, few, rng, ref),
        "second writer of a rank": second_writer_trials(work, max(few // 4, 1), rng, ref),
    }
  finally:
    shutil.rmtree(work)


def main():
  global layout
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--trials", type=int, default=40, help="trials of kill -9 (others: half)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--layouts", default="compact,packed",
                      help="comma-separated cache layouts, one table each")
  parser.add_argument("--child", nargs=4, metavar=("DATA", "CACHE", "RANK", "LAYOUT"),
                      help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    data, path, rank, layout = args.child
    return write(data, path, rank=int(rank))
  for layout in args.layouts.split(","):
    table = faults(args.trials, np.random.default_rng(args.seed))
    print(f"\n{ROWS} rows x {T} positions, {REGIONS} regions of {REGION_ROWS} rows, k = {K}, "
          f"{layout}; seed {args.seed}\n")
    print("| fault | trials | detected | positions lost (mean, max) | "
          "byte-identical after repair |")
    print("|---|---|---|---|---|")
    for fault, rows in table.items():
      detected, lost, same = zip(*rows)
      print(f"| {fault} | {len(rows)} | {sum(detected)}/{len(rows)} | {np.mean(lost):.0f}, "
            f"{max(lost)} | {sum(same)}/{len(rows)} |", flush=True)


if __name__ == "__main__":
  main()
