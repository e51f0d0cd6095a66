# BalanceRoute: every task a developer or CI runs. `make help` lists them.
SHELL := /bin/bash
CARGO ?= cargo

.PHONY: help build run test lint fmt fmt-check clippy unit python-tests deploy-tools browser gateways deploy-check bench sim ci chaos fuzz soak flake-hunt flake-hunt-smoke soak-smoke bench-memory-return bench-cost bench-cost-smoke e2e-vllm vllm-step-model vllm-moe-live import-cycles config-reference config-reference-check

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

build: ## build every binary (release)
	$(CARGO) build --release --workspace --bins

run: ## the demo: the whole control plane on loopback, JSQ vs BR-0 on a paper-shaped workload
	bash scripts/demo.sh

test: fmt-check clippy import-cycles unit config-reference-check python-tests e2e-vllm flake-hunt-smoke soak-smoke bench-cost-smoke ## everything CI checks: format, lints, all tests
	@echo "make test: all checks passed"

fmt: ## format the code
	$(CARGO) fmt --all

fmt-check:
	$(CARGO) fmt --all -- --check

import-cycles: ## no crate's modules import each other in a cycle (tools/dev/import-cycles.py)
	mkdir -p target && python3 tools/dev/test_import_cycles.py 2> target/import-cycles-test.log \
		|| { cat target/import-cycles-test.log; exit 1; }
	python3 tools/dev/import-cycles.py > target/import-cycles.log \
		|| { grep -v 'no cycles' target/import-cycles.log; exit 1; }

clippy: ## lints, warnings denied
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

lint: fmt-check clippy import-cycles config-reference-check ## format check + clippy + no module import cycles + docs/configuration.md current

# Property tests draw their cases from a fixed seed here (PROPTEST_RNG_SEED; set it to draw
# others), so CI's result depends on the commit alone: a generator edge found by chance fails
# whichever change draws it, not the one that made it. `make flake-hunt` draws fresh cases.
unit: ## Rust unit, property, integration and end-to-end tests (deploy validation if `make deploy-tools` ran)
	PROPTEST_RNG_SEED=$${PROPTEST_RNG_SEED:-20261202} $(CARGO) test --workspace --locked

python-tests: ## third-party clients (openai, grpcio) against the real binaries
	bash scripts/python-tests.sh

e2e-vllm: ## end-to-end tests against a real vLLM (CPU build, data parallel; installed pinned into target/vllm)
	mkdir -p target && python3 scripts/vllm/test_step_samples.py 2> target/step-samples-test.log \
		|| { cat target/step-samples-test.log; exit 1; }
	bash scripts/e2e-vllm.sh

vllm-step-model: ## fit br-sim's step model to a real vLLM rank's measured step times (scripts/vllm/step-model.sh)
	bash scripts/vllm/step-model.sh

vllm-moe-live: ## JSQ vs BR-0 live on a real MoE vLLM (tiny Mixtral, DP = 2 in lockstep) and the twin on the same arrivals
	bash scripts/vllm/moe-live.sh

deploy-tools: ## fetch kustomize, promtool and the Python validators into target/ (package registries)
	bash deploy/validate.sh --install-only

browser: ## install headless Chromium (Debian's package) for the live page's test
	bash scripts/install-browser.sh

gateways: ## install nginx with its Lua module and HAProxy (Debian's packages) for the Lua gateways' tests
	bash scripts/install-gateways.sh

deploy-check: deploy-tools ## render and validate the Kubernetes manifests, dashboard and alerts
	bash deploy/validate.sh --no-install

fuzz: ## libFuzzer over every decoder and validator for FUZZ_SECONDS (default 60): scripts/fuzz.sh
	scripts/fuzz.sh

soak: ## the whole control plane for SOAK_MINUTES (default 30) at a rate sized to the machine: RSS, descriptors, σ and p99 flat per request (scripts/soak.sh)
	scripts/soak.sh

# CI's two-minute form of the soak (debug build, the rate measured as in the full run), after
# the verdict's own tests.
soak-smoke:
	mkdir -p target && python3 scripts/lib/test_soak_verdict.py 2> target/soak-verdict-test.log \
		|| { cat target/soak-verdict-test.log; exit 1; }
	SOAK_MINUTES=2 SOAK_PROFILE=debug SOAK_WARMUP=30 SOAK_INTERVAL=5 SOAK_PROBE_SECONDS=10 \
		SOAK_OUT=target/soak-smoke bash scripts/soak.sh > target/soak-smoke.log 2>&1 \
		|| { cat target/soak-smoke.log; exit 1; }
	grep -E '^(==> probe|==> soak|  |verdict)' target/soak-smoke.log

bench-memory-return: ## br-all's RSS after a load: idle, at its end, 30 and 90 s later, and when it is back within 2x of idle
	bash scripts/bench-memory-return.sh

flake-hunt: ## every test binary FLAKE_ROUNDS times (default 10), two at once: the rare failures CI meets now and then (scripts/flake-hunt.sh)
	bash scripts/flake-hunt.sh

# CI's short form of the flake hunt: one round of one small binary (the build is `make unit`'s),
# so the script's own path from build to verdict keeps working.
flake-hunt-smoke:
	FLAKE_ROUNDS=1 FLAKE_FILTER='/br_backoff-' FLAKE_OUT=target/flake-hunt-smoke \
		bash scripts/flake-hunt.sh > target/flake-hunt-smoke.log 2>&1 \
		&& grep -Eq '^[0-9]+ runs, 0 failed$$' target/flake-hunt-smoke.log \
		|| { cat target/flake-hunt-smoke.log; exit 1; }

chaos: ## seeded chaos (kill -9, frozen connections under load) for MINUTES (default 10): scripts/chaos.sh
	scripts/chaos.sh --minutes $(or $(MINUTES),10)

bench: ## benchmarks (results are recorded in docs/benchmarks.md)
	$(CARGO) bench -p br-core --bench dispatcher
	$(CARGO) run --release -p br-core --example tick_percentiles

# The reference is what the binaries' --help prints, which is the same in every profile: the dev
# build (incremental, and the one `make unit` has just made) serves, so no release build is needed.
CONFIG_REFERENCE_PACKAGES := -p br-all -p br-snapshot -p br-ingest -p br-decision -p br-shim -p brctl -p br-sim -p br-emu -p br-certs
CONFIG_REFERENCE_BIN = $${CARGO_TARGET_DIR:-target}/debug

config-reference: ## regenerate docs/configuration.md from the binaries' --help (dev build)
	$(CARGO) build -q --locked --bins $(CONFIG_REFERENCE_PACKAGES)
	BR_BIN="$(CONFIG_REFERENCE_BIN)" bash scripts/config-reference.sh

config-reference-check: ## fail if docs/configuration.md differs from the binaries' --help (dev build)
	$(CARGO) build -q --locked --bins $(CONFIG_REFERENCE_PACKAGES)
	BR_BIN="$(CONFIG_REFERENCE_BIN)" bash scripts/config-reference.sh --check

# RATE, EVENTS and GROUPS: the offered load (Assign/s, progress events/s, groups). GROUPS is a
# make variable here only: bash keeps a read-only GROUPS of its own, hence BENCH_GROUPS below.
bench-cost: ## CPU per Assign and per progress event, and added p99, of br-all and the split deployment against a do-nothing floor server, side by side (scripts/bench-cost.sh)
	BENCH_RATE=$(or $(RATE),5000) BENCH_EVENTS=$(or $(EVENTS),100000) BENCH_GROUPS=$(or $(GROUPS),1) \
		bash scripts/bench-cost.sh

# CI's short form: one round of 2 s phases on the dev build `make unit` made, so the script's
# path from start-up to its last line keeps working; the figures of a debug build under CI's
# load mean nothing and are not read.
bench-cost-smoke:
	$(CARGO) build -q --locked -p br-all -p br-snapshot -p br-decision -p br-bench --bins
	BENCH_SKIP_BUILD=1 BENCH_PROFILE=debug BENCH_RATE=200 BENCH_EVENTS=2000 BENCH_GROUPS=2 \
		BENCH_DURATION=2s BENCH_ROUNDS=1 BENCH_OUT=target/bench-cost-smoke \
		bash scripts/bench-cost.sh > target/bench-cost-smoke.log 2>&1 \
		&& tail -n 1 target/bench-cost-smoke.log | grep -Eq '^cost ratio: br-all CPU [0-9]+\.[0-9]{2}x p99 [0-9]+\.[0-9]{2}x, split CPU [0-9]+\.[0-9]{2}x p99 [0-9]+\.[0-9]{2}x$$' \
		|| { cat target/bench-cost-smoke.log; exit 1; }

sim: ## the digital twin on the paper-shaped Azure workload, G = 8
	$(CARGO) run --release -p br-sim -- --trace paper-azure --workers 8 --slots 256 --policies random,rr,p2c,jsq,vllm-dp,mintok,br0,br0-bypass,brh,brh-oracle --arrival saturated

ci: deploy-tools browser gateways ## what .ci/run calls: the deploy tools, the browser and the gateways, then the tests (which must use them)
	BR_REQUIRE_DEPLOY_TOOLS=1 BR_REQUIRE_BROWSER=1 BR_REQUIRE_GATEWAYS=1 BR_REQUIRE_PID_REUSE=1 $(MAKE) test
