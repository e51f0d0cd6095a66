#!/usr/bin/env bash
# libFuzzer over every decoder and validator a peer reaches, for FUZZ_SECONDS (60):
# installs cargo-fuzz into target/tools on first use (crates.io), seeds the corpus with valid
# messages of every kind, and runs fuzz/'s `decode` target. The stable toolchain is enough:
# RUSTC_BOOTSTRAP lets cargo-fuzz pass its -Z instrumentation flags. Findings land in
# fuzz/artifacts/decode/; replay one with `cargo fuzz run decode FILE`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
TOOLS="$TARGET_DIR/tools"
if [ ! -x "$TOOLS/bin/cargo-fuzz" ]; then
    echo "==> installing cargo-fuzz into $TOOLS"
    cargo install cargo-fuzz --version 0.13.2 --locked --root "$TOOLS"
fi
CORPUS="$TARGET_DIR/fuzz-corpus/decode"
mkdir -p "$CORPUS"
cargo run -q -p br-proto --example fuzz_seeds -- "$CORPUS"
cd fuzz
# its own target dir: the instrumented build must not replace the workspace's artefacts
CARGO_TARGET_DIR="$TARGET_DIR/fuzz" RUSTC_BOOTSTRAP=1 "$TOOLS/bin/cargo-fuzz" run decode "$CORPUS" \
    -- -max_total_time="${FUZZ_SECONDS:-60}" -max_len=4096
