#!/bin/bash
# Two servers on core 0 taking turns under wrk (core 1), C connections, R rounds of 5 s each, the order swapped
# every round: A, the service of BASE_TREE (a `git worktree add` of 871993e), on 8123; B, the working tree, on 8124.
#   BASE_TREE=/tmp/base REPO=$PWD OUT=/tmp/ab LUA=$OUT/post.lua bash ab_one_connection.sh 1 10
# LUA: a wrk script posting one JSON text to /classify (post.lua: a 73-token review, post16.lua: a 15-token one, here).
# Twenty-sixth session, for the lone-text-on-the-event-loop change (README.md here); outputs ab-c1-*.txt.
C=${1:-16}; R=${2:-6}
REPO=${REPO:-$PWD}; OUT=${OUT:-/tmp/ab}; mkdir -p "$OUT"
export LINFORMER_CLASSIFY_MODEL=classify-linformer LINFORMER_TRANSLATE_MODEL= LINFORMER_ORT_INTRA_OP_THREADS=1 LINFORMER_ORT_INTER_OP_THREADS=1 LINFORMER_LOG_LEVEL=warning
(cd "$BASE_TREE" && LINFORMER_PORT=8123 taskset -c 0 "$REPO"/.venv/bin/python -m service > "$OUT"/a.log 2>&1) &
(cd "$REPO" && LINFORMER_PORT=8124 taskset -c 0 .venv/bin/python -m service > "$OUT"/b.log 2>&1) &
for p in 8123 8124; do for i in $(seq 60); do curl -sf localhost:$p/readyz >/dev/null && break; sleep 0.5; done; done
for p in 8123 8124; do taskset -c 1 wrk -t1 -c$C -d3s -s ${LUA:-"$OUT"/post.lua} http://127.0.0.1:$p/classify >/dev/null; done
for r in $(seq $R); do for p in $( [ $((r % 2)) = 1 ] && echo "8123 8124" || echo "8124 8123"); do
  echo "$p $(taskset -c 1 wrk -t1 -c$C -d5s --latency -s ${LUA:-"$OUT"/post.lua} http://127.0.0.1:$p/classify | grep -E ' 50%| 99%|Requests/sec' | tr -s ' ' | tr '\n' ' ')"
done; done
pkill -f "python -m service"; wait
