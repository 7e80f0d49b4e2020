#!/usr/bin/env bash
# Fewer, larger segments on the Milvus 2.3.5 standalone server: does the public caller's
# filtered dense search at 1M cost close to 10k?
#
#   bash bench/milvus_segments/run.sh 10000 1000000          # sizes (default: 10000)
#
# 1. starts a fresh server (data dir $MSEG/srv) with the segment settings below, held by
#    server.py (beside this script); its `milvus` binary PID goes to bench --pid (CPU / RSS);
# 2. per size: bench/milvus_scaling.py --insert-only (insert, no flush), then
#    segments.py (flush, wait until every segment >= 1,024 rows has its HNSW index
#    loaded, compact if a partition has more than one segment, wait for the handoff and the new
#    indexes; prints segments and rows per segment -> $MSEG/segments.jsonl), then the bench
#    again on the same --workdir (no insert left: waits for indexes, searches; rows appended to
#    $MSEG/rows.jsonl; the collection is dropped after its searches);
# 3. stops the server by PID (the holder stops the binary; the binary's PID is checked after).
#
# 4. with PAIRED=1 (two sizes), the collections are kept after their own searches and then
#    searched in turn, query by query, by paired.py (beside this script): the same machine
#    for both sizes, the ratio per round -> $MSEG/paired.jsonl.
#
# Overrides: MSEG_SET="key=value ..." adds/overrides milvus.yaml keys; QUERIES (100); EF (64);
# MSEG_COMPACT=auto|always|never (auto); PAIRED (0); PAIRED_EF (EF; e.g. "64 128"). Everything is logged to $MSEG/run.log
# (MSEG: /tmp/milvus-segments unless set).
set -euo pipefail

MSEG=${MSEG:-/tmp/milvus-segments}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=$REPO/.venv/bin/python
SIZES=("${@:-10000}")
QUERIES=${QUERIES:-100}
EF=${EF:-64}  # HNSW search breadth of the searches
PAIRED=${PAIRED:-0}
KEEP=()
[ "$PAIRED" = 1 ] && KEEP=(--keep)
COMPACT=${MSEG_COMPACT:-auto}
SRV=$MSEG/srv
WORK=$MSEG/work
INFO=$MSEG/server.json
LOG=$MSEG/run.log

# Segment sizing. Milvus estimates a row of this schema at ~2.6 KB (VARCHAR max_length, not
# the data: 207,200 rows = 512 MB at the default maxSize), so 1M rows need ~2.5 GB: 8192 MB
# gives a max of ~3.3M rows per segment (room for 1M even if partitions hash together).
# The ~210k-row segments seen with maxSize 2048 come from maxBinlogFileNumber (32): a growing
# segment is sealed after 32 buffer flushes of insertBufSize (16 MB ~ 6,475 estimated rows,
# 32 x 6,475 = 207,200) whatever maxSize says; 1024 files and a 64 MB buffer lift that, so a
# partition's growing segment is sealed only by the flush (or 0.9 x max rows).
SETS=(
  dataCoord.segment.maxSize=8192
  dataCoord.segment.sealProportion=0.9
  dataCoord.segment.maxBinlogFileNumber=1024
  dataNode.segment.insertBufSize=67108864
)
# shellcheck disable=SC2206
SETS+=(${MSEG_SET:-})

mkdir -p "$MSEG"
exec > >(tee -a "$LOG") 2>&1
echo "=== $(date -Is) run.sh ${SIZES[*]} (queries $QUERIES, compact $COMPACT); load $(cut -d' ' -f1-3 /proc/loadavg)"

rm -rf "$SRV" "$WORK" "$INFO"
mkdir -p "$WORK"
HOLDER=""
PID=""

stop_server() {
  set +e
  if [ -n "$HOLDER" ] && kill -0 "$HOLDER" 2>/dev/null; then
    echo "stopping server holder PID $HOLDER (milvus PID $PID)"
    kill -TERM "$HOLDER"
    for _ in $(seq 60); do kill -0 "$HOLDER" 2>/dev/null || break; sleep 0.5; done
  fi
  if [ -n "$PID" ] && kill -0 "$PID" 2>/dev/null; then
    echo "milvus PID $PID still running: SIGTERM"
    kill -TERM "$PID"
    for _ in $(seq 30); do kill -0 "$PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$PID" 2>/dev/null && { echo "SIGKILL $PID"; kill -KILL "$PID"; }
  fi
  [ -n "$PID" ] && ! kill -0 "$PID" 2>/dev/null && echo "milvus PID $PID stopped"
}
trap stop_server EXIT

ARGS=()
for kv in "${SETS[@]}"; do ARGS+=(--set "$kv"); done
"$PY" "$HERE/server.py" "$SRV" "$INFO" "${ARGS[@]}" > "$MSEG/server.log" 2>&1 &
HOLDER=$!
for _ in $(seq 300); do
  [ -f "$INFO" ] && break
  kill -0 "$HOLDER" 2>/dev/null || { echo "server did not start:"; cat "$MSEG/server.log"; exit 1; }
  sleep 1
done
[ -f "$INFO" ] || { echo "server did not start in 300 s"; exit 1; }
URI=$("$PY" -c "import json;print(json.load(open('$INFO'))['uri'])")
PID=$("$PY" -c "import json;print(json.load(open('$INFO'))['pid'])")
echo "server $URI, milvus PID $PID, holder PID $HOLDER; config $SRV/configs/milvus.yaml:"
grep -nE "^    (maxSize|sealProportion|maxBinlogFileNumber|insertBufSize):" "$SRV/configs/milvus.yaml"

cd "$REPO"
for n in "${SIZES[@]}"; do
  echo "--- $n: insert ($(date +%T), load $(cut -d' ' -f1 /proc/loadavg))"
  "$PY" bench/milvus_scaling.py --backends server --sizes "$n" --queries "$QUERIES" \
    --uri "$URI" --pid "$PID" --workdir "$WORK" --insert-only
  echo "--- $n: seal, index, compact ($(date +%T))"
  "$PY" "$HERE/segments.py" --uri "$URI" --collection "scale_server_$n" --rows "$n" \
    --compact "$COMPACT" --json "$MSEG/segments.jsonl" --timeout-s 3600
  echo "--- $n: search ($(date +%T), load $(cut -d' ' -f1 /proc/loadavg))"
  "$PY" bench/milvus_scaling.py --backends server --sizes "$n" --queries "$QUERIES" \
    --uri "$URI" --pid "$PID" --workdir "$WORK" --ef "$EF" --json "$MSEG/rows.jsonl" \
    ${KEEP[@]+"${KEEP[@]}"}
  echo "--- $n: done ($(date +%T))"
done
if [ "$PAIRED" = 1 ]; then
  echo "--- paired: ${SIZES[*]} in turn ($(date +%T), load $(cut -d' ' -f1 /proc/loadavg))"
  "$PY" "$HERE/paired.py" --uri "$URI" --sizes "${SIZES[@]}" --queries "$QUERIES" \
    --ef ${PAIRED_EF:-$EF} --json "$MSEG/paired.jsonl"
fi
echo "server RSS before stop: $(ps -o rss= -p "$PID" 2>/dev/null | awk '{printf "%.0f MB", $1/1024}')"
echo "=== $(date -Is) done"
