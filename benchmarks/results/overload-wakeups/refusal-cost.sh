#!/bin/bash
# cost of one refusal on the server's core: a server that admits 1 at a time and refuses the rest, wrk at full rate
cd "$(git rev-parse --show-toplevel)"
cat > /tmp/refuse.lua <<'LUA'
wrk.method = "POST"
wrk.body = '{"text": "This film was a delight from start to finish, with a sharp script and a cast that clearly enjoyed every scene of it."}'
wrk.headers["Content-Type"] = "application/json"
LUA
LINFORMER_TRANSLATE_MODEL= LINFORMER_ORT_INTRA_OP_THREADS=1 LINFORMER_ORT_INTER_OP_THREADS=1 LINFORMER_LOG_LEVEL=warning \
LINFORMER_MAX_CONCURRENT_REQUESTS=1 LINFORMER_MAX_WAITING_REQUESTS=0 LINFORMER_SHED_CONCURRENT_REQUESTS=1 \
  taskset -c 0 .venv/bin/python -m service --port 8931 > /tmp/refuse-srv.log 2>&1 &
sleep 8
pid=$(pgrep -f "service --port 8931" | head -1)
taskset -c 1 wrk -t1 -c64 -d4s -s /tmp/refuse.lua http://127.0.0.1:8931/classify > /dev/null
c0=$(curl -s localhost:8931/metrics | grep -E 'linformer_requests_total\{route="/classify"' )
t0=$(awk '{print $14+$15}' /proc/$pid/stat)
taskset -c 1 wrk -t1 -c64 -d10s -s /tmp/refuse.lua http://127.0.0.1:8931/classify
t1=$(awk '{print $14+$15}' /proc/$pid/stat)
u=$(awk '{print $14}' /proc/$pid/stat)
c1=$(curl -s localhost:8931/metrics | grep -E 'linformer_requests_total\{route="/classify"' )
echo "before: $c0"; echo "after: $c1"; echo "cpu ticks (utime+stime) during 10 s: $((t1-t0))"
perf stat -e task-clock,context-switches -p $pid -- sleep 0.1 >/dev/null 2>&1
taskset -c 1 wrk -t1 -c64 -d12s -s /tmp/refuse.lua http://127.0.0.1:8931/classify > /dev/null &
wrk_pid=$!
sleep 2
perf record -F 2000 -g -p $pid -o /tmp/refuse.perf -- sleep 6 2>&1 | tail -1
perf report -i /tmp/refuse.perf --no-children --sort dso -q 2>/dev/null | head -15
wait $wrk_pid
kill $pid
