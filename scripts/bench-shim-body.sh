#!/usr/bin/env bash
# What one large request body costs br-shim (docs/benchmarks.md, "bounds"): starts a
# stand-in engine (scripts/lib/echo_upstream.py: reads the body, answers a small streamed
# completion) and one br-shim in front of it (no ingest), then sends one body of each shape and
# prints the shim's peak RSS (VmHWM) above its idle RSS, as a multiple of the body's size. Each
# shape gets a fresh shim, so every peak is that body's own.
#
#   cargo build -p br-shim --bins          (or --release, with PROFILE=release)
#   scripts/bench-shim-body.sh                 # 15 MB bodies: string, tokens, messages
#
# SIZE_MB (15) sets the body size, SHIM another br-shim binary (the one before a change);
# logs and bodies go to target/bench-shim-body/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BIN="${CARGO_TARGET_DIR:-$ROOT/target}/${PROFILE:-debug}"
SHIM="${SHIM:-$BIN/br-shim}"
OUT="${CARGO_TARGET_DIR:-$ROOT/target}/bench-shim-body"
SIZE_MB="${SIZE_MB:-15}"
mkdir -p "$OUT"
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT

rm -f "$OUT/upstream.port"
python3 "$ROOT/scripts/lib/echo_upstream.py" "$OUT/upstream.port" &
PIDS+=($!)
for _ in $(seq 1 100); do [ -s "$OUT/upstream.port" ] && break; sleep 0.1; done
UPSTREAM="http://127.0.0.1:$(cat "$OUT/upstream.port")"

# The bodies: about SIZE_MB each, "stream": true first (the shim then asks for usage chunks).
python3 - "$OUT" "$SIZE_MB" <<'PY'
import json, sys
out, mb = sys.argv[1], int(sys.argv[2])
size = mb * 1_000_000
shapes = {
    "string": lambda: {"stream": True, "model": "m", "max_tokens": 16, "prompt": "a" * size},
    "tokens": lambda: {"stream": True, "model": "m", "max_tokens": 16, "prompt": [12345] * (size // 6)},
    "messages": lambda: {"stream": True, "model": "m", "max_tokens": 16,
                         "messages": [{"role": "user", "content": "hello there"}] * (size // 42)},
}
for name, make in shapes.items():
    with open(f"{out}/{name}.json", "w") as f:
        json.dump(make(), f, separators=(",", ":"))
PY

kb() { awk -v k="$1" '$1 == k":" {print $2}' "/proc/$2/status"; }
printf '%-9s %10s %10s %10s %8s %s\n' shape body_MB idle_MB peak_MB xbody http
for shape in string tokens messages; do
    ready="$OUT/ready-$shape.json"
    rm -f "$ready"
    "$SHIM" --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --ready-file "$ready" \
        --upstream "$UPSTREAM" --ingest-addr "" --max-body-bytes $(( (SIZE_MB + 2) * 1000000 )) \
        >"$OUT/shim-$shape.log" 2>&1 &
    pid=$!
    PIDS+=($pid)
    for _ in $(seq 1 300); do [ -s "$ready" ] && break; sleep 0.1; done
    [ -s "$ready" ] || { echo "br-shim wrote no ready file" >&2; exit 1; }
    http=$(sed -E 's/.*"http": *"([^"]+)".*/\1/' "$ready")
    idle=$(kb VmRSS $pid)
    body_bytes=$(stat -c %s "$OUT/$shape.json")
    code=$(curl -sS -o /dev/null -w '%{http_code}' -H 'Content-Type: application/json' \
        --data-binary "@$OUT/$shape.json" "http://$http/v1/completions")
    peak=$(kb VmHWM $pid)
    awk -v s="$shape" -v b="$body_bytes" -v i="$idle" -v p="$peak" -v c="$code" 'BEGIN {
        printf "%-9s %10.1f %10.1f %10.1f %8.1f %s\n", s, b / 1e6, i * 1024 / 1e6, p * 1024 / 1e6,
            (p - i) * 1024 / b, c }'
    kill "$pid"
    wait "$pid" 2>/dev/null || true
done
