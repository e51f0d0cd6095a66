#!/usr/bin/env bash
# Memory after a load (`make bench-memory-return`): does a service give back what a load took?
# br-all (release, its defaults but the group list) starts on free loopback ports and idles
# MEM_IDLE seconds (5); its RSS then is the idle level. Then the load, for MEM_LOAD seconds (10):
#   MEM_KIND=assign (default)   assign-load sends MEM_RATE Assign/s (5000) and MEM_EVENTS
#                               progress events/s (100000);
#   MEM_KIND=http-bodies        MEM_CONNECTIONS (2000) HTTP/JSON connections each send 40,000
#                               bytes of a 60,000-byte Assign body and never the rest, held until
#                               the load's end and then closed (scripts/lib/hold_http_bodies.py).
# Then RSS is read every second for MEM_AFTER seconds (90). Prints the idle, peak and final RSS,
# the RSS 30 s after the load with its ratio to idle, and how long RSS took to come within 2x of
# idle.
#
# Environment: MEM_KIND, MEM_RATE, MEM_EVENTS, MEM_CONNECTIONS, MEM_LOAD, MEM_IDLE, MEM_AFTER,
# MEM_ARGS (extra br-all
# flags, e.g. "--answered-ttl 1s"), MEM_ENV (extra environment for br-all alone, e.g. other
# allocator settings: "_RJEM_MALLOC_CONF=dirty_decay_ms:10000"), BENCH_SKIP_BUILD=1, MEM_OUT
# (target/bench-memory-return).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RATE="${MEM_RATE:-5000}"
EVENTS="${MEM_EVENTS:-100000}"
LOAD="${MEM_LOAD:-10}"
IDLE="${MEM_IDLE:-5}"
AFTER="${MEM_AFTER:-90}"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release"
OUT="${MEM_OUT:-${CARGO_TARGET_DIR:-$ROOT/target}/bench-memory-return}"
mkdir -p "$OUT"
OUT_LOGS="$OUT"
# shellcheck source=scripts/lib/stack.sh
source "$ROOT/scripts/lib/stack.sh"

if [ "${BENCH_SKIP_BUILD:-0}" != 1 ]; then
    cargo build --release -q --locked -p br-all -p br-bench --bins
fi
rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }

[ -n "${MEM_ENV:-}" ] && echo "br-all's extra environment: $MEM_ENV"
echo "machine: $(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo), $(nproc) cores;" \
    "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)');" \
    "$(date -u '+%Y-%m-%d %H:%M UTC'); load average $(cut -d' ' -f1-3 /proc/loadavg)"

free_ports 3 A
# shellcheck disable=SC2086 # MEM_ENV and MEM_ARGS are split on purpose
start br-all env ${MEM_ENV:-} "$BIN/br-all" --listen "127.0.0.1:$A" --admin-listen "127.0.0.1:$((A + 1))" \
    --http-listen "127.0.0.1:$((A + 2))" --policy br0 --groups default ${MEM_ARGS:-}
PID=$LAST_PID
wait_http "http://127.0.0.1:$((A + 1))/livez" br-all
sleep "$IDLE"
idle=$(rss_kib "$PID")

case "${MEM_KIND:-assign}" in
assign)
    "$BIN/assign-load" --decision-addr "http://127.0.0.1:$A" --snapshot-addr "http://127.0.0.1:$A" \
        --group default --rate "$RATE" --duration "${LOAD}s" --warmup 1s --workers 8 --capacity 512 \
        --progress-events "$EVENTS" --hold 300ms >"$OUT/load.txt"
    what="$RATE Assign/s + $EVENTS progress events/s for ${LOAD}s ($(grep -m1 -i 'answered' "$OUT/load.txt" || true))"
    ;;
http-bodies)
    python3 "$ROOT/scripts/lib/hold_http_bodies.py" "127.0.0.1:$((A + 2))" \
        --connections "${MEM_CONNECTIONS:-2000}" --hold "$LOAD" >"$OUT/load.txt"
    what="$(cat "$OUT/load.txt"), held ${LOAD}s"
    ;;
*)
    echo "MEM_KIND must be assign or http-bodies, not ${MEM_KIND}" >&2
    exit 2
    ;;
esac
peak=$(awk '/^VmHWM:/ {print $2}' "/proc/$PID/status")
end=$(rss_kib "$PID")

within=""
at30=""
printf 's_after_load,rss_kib\n' >"$OUT/rss.csv"
for t in $(seq "$AFTER"); do
    sleep 1
    r=$(rss_kib "$PID")
    printf '%d,%d\n' "$t" "$r" >>"$OUT/rss.csv"
    [ "$t" = 30 ] && at30=$r
    [ -z "$within" ] && [ "$r" -le $((2 * idle)) ] && within=$t
done
final=$(rss_kib "$PID")
mib() { awk -v k="$1" 'BEGIN { printf "%.1f MiB", k / 1024 }'; }
echo "load: $what"
echo "br-all RSS: idle $(mib "$idle"), peak $(mib "$peak"), at the load's end $(mib "$end")," \
    "30 s after $(mib "${at30:-$final}") ($(awk -v a="${at30:-$final}" -v i="$idle" 'BEGIN { printf "%.2fx", a / i }') idle)," \
    "${AFTER} s after $(mib "$final")"
if [ -n "$within" ]; then
    echo "within 2x of idle: $within s after the load"
else
    echo "within 2x of idle: not within ${AFTER} s"
fi
