#!/usr/bin/env bash
# Does a restructuring change any number? Runs the CPU smoke variants of configs/demo.py,
# configs/8k.py and configs/32k.py (every stage: data, pretrain, cache, train, baseline, eval,
# export, as each config lists them) at commit OLD and at the working tree, and compares each
# run's per-step metrics (step, loss, ce, kl, grad_norm, top1), eval.json, the caches' and data
# stores' arrays (all files but the zarr.json metadata, which holds the creation time) and the
# exported checkpoint, byte for byte.
#   bash experiments/bench/same_numbers.sh OLD [CONFIGS...]      (default: demo 8k 32k)
set -u
old=$1; shift
configs=${*:-demo 8k 32k}
repo=$(cd "$(dirname "$0")/../.." && pwd)
py=$repo/.venv/bin/python
tree=$(mktemp -d)/old
git -C "$repo" worktree add -q --detach "$tree" "$old" || exit 2
out=$(mktemp -d)
status=0
numbers() {  # a metrics.jsonl's numbers, step by step (not its times)
  "$py" -c "import json,sys
for l in open(sys.argv[1]):
  d=json.loads(l); print([d.get(k) for k in ('step','loss','ce','kl','grad_norm','top1')])" "$1"
}
for cfg in $configs; do
  for side in old new; do
    dir=$([ $side = old ] && echo "$tree" || echo "$repo")
    (cd "$dir" && JAX_PLATFORMS=cpu "$py" -m kdjax.main --config="configs/$cfg.py:smoke" \
      --config.workdir="$out/$side-$cfg" > "$out/$side-$cfg.log" 2>&1) \
      || { echo "$cfg: the $side run failed, see $out/$side-$cfg.log"; status=1; continue 2; }
  done
  same=yes
  for metrics in "$out"/old-"$cfg"/*/metrics.jsonl; do
    run=$(basename "$(dirname "$metrics")")
    cmp -s <(numbers "$metrics") <(numbers "$out/new-$cfg/$run/metrics.jsonl") \
      || { echo "$cfg: $run's metrics differ"; same=no; }
  done
  cmp -s "$out/old-$cfg/eval.json" "$out/new-$cfg/eval.json" || { echo "$cfg: eval.json differs"; same=no; }
  for part in cache data export; do
    [ -d "$out/old-$cfg/$part" ] || continue
    diff -rq -x zarr.json "$out/old-$cfg/$part" "$out/new-$cfg/$part" > /dev/null \
      || { echo "$cfg: $part differs"; same=no; }
  done
  echo "$cfg: identical to $old: $same"
  [ $same = yes ] || status=1
done
git -C "$repo" worktree remove --force "$tree"
exit $status
