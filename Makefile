# sagaflow — run `make` for the list of targets.
SHELL := /bin/bash
GO    ?= go
PKGS  := ./...
STATICCHECK := honnef.co/go/tools/cmd/staticcheck@v0.8.2
# unparam has no tagged release; this is its newest version on the module proxy.
UNPARAM     := mvdan.cc/unparam@v0.0.0-20260823230713-2fa3d841b0c8
# The test harness's container fallback: a module of its own, so that
# sagaflow's go.mod needs no testcontainers, Docker or moby module.
PGCONTAINER := internal/pgtest/pgcontainer

.DEFAULT_GOAL := help

.PHONY: help
help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_\/-]+:.*## / {printf "  %-14s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: demo
demo: ## run the checkout example: four services over Kafka, nine scenarios, an order's span tree, a summary; UI=127.0.0.1:8080 then serves the web UI on its data
	$(GO) run ./examples/checkout/cmd/demo $(if $(UI),-ui $(UI))

.PHONY: demo/nats
demo/nats: ## the same demo over NATS JetStream (a throwaway nats-server; NATS_URL=nats://… for yours)
	$(GO) run ./examples/checkout/cmd/demo -bus nats $(if $(NATS_URL),-nats-url $(NATS_URL))

# The crash-point matrix and the short chaos soak need a build whose fault
# points can be armed (-tags sagaflow_faults); they run without the race
# detector, in worker processes of their own.
CHAOS_TAGS := -tags sagaflow_faults

.PHONY: test
test: ## run every test against a real PostgreSQL, with the race detector; then the crash matrix and a short chaos soak
	$(GO) test -race -count=1 -timeout 15m $(SLOW_FIRST) $(PKGS)
	$(GO) test $(CHAOS_TAGS) -count=1 -timeout 15m -v -parallel $(CHAOS_PARALLEL) -run 'TestCrashMatrix|TestSoakShort|TestCheckersCatch' ./internal/chaos/

# The test packages that take longest, first: go test starts packages in the
# order given, and the slowest (saga, 150 s under -race) came last and ran
# alone at the end of the run. The rest of ./... follows.
SLOW_FIRST := ./saga ./internal/review15 ./internal/review16 ./internal/review26 ./internal/review27 \
	./internal/review14 ./internal/review10 ./internal/review17 ./transport/rabbitbus ./internal/review9 \
	./examples/checkout/shop ./relay

# Cells, soaks and controls at a time in `make test`. A cell mostly waits (for
# its node, its server, its sagas' timers): four at a time left two cores 60-70%
# idle here, and the chaos step took 5.1 min instead of 7.7 at two.
CHAOS_PARALLEL ?= 4
CHAOS_DURATION ?= 5m
CHAOS_SEEDS    ?= 3
BUS            ?= kafka

.PHONY: chaos
chaos: ## chaos soak: worker processes killed, paused, PostgreSQL restarted, broker outages (CHAOS_DURATION, default 5m; BUS=nats over NATS JetStream)
	$(GO) run $(CHAOS_TAGS) ./internal/chaos/cmd/chaos soak -duration $(CHAOS_DURATION) -bus $(BUS)

.PHONY: chaos/matrix
chaos/matrix: ## every crash point x {SIGKILL, PostgreSQL restart, broker outage} x CHAOS_SEEDS seeds (default 3)
	$(GO) run $(CHAOS_TAGS) ./internal/chaos/cmd/chaos matrix -seeds $(CHAOS_SEEDS)

.PHONY: test/short
test/short: ## run every test without the race detector (quicker)
	$(GO) test -count=1 -timeout 15m $(PKGS)

.PHONY: test/race
test/race: ## run the suite five times with the race detector, to shake out flakes
	$(GO) test -race -count=5 -timeout 30m $(PKGS)

FUZZTIME ?= 30s
FUZZ_TARGETS := FuzzDecodeCommand:./saga FuzzClaimedFromKafka:./saga FuzzPersistedState:./saga FuzzFromKafka:./inbox \
	FuzzBuildMessage:./relay FuzzDecodeCursor:./internal/store FuzzParseKey:./steps \
	FuzzParseKey:./wire FuzzDecodeCommand:./wire FuzzDecodeReply:./wire

.PHONY: fuzz
fuzz: ## fuzz every decoder of untrusted bytes for FUZZTIME each (default 30s)
	@set -e; for t in $(FUZZ_TARGETS); do \
		name=$${t%%:*}; pkg=$${t#*:}; echo "== $$name ($$pkg)"; \
		$(GO) test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) $$pkg; \
	done

# unparam (unused parameters and results, parameters that always receive the
# same value) checks the packages without their tests: a test helper written
# to read well at its call sites, such as count(query, args...), is not a
# defect when every caller passes the same value. It has no -tags flag, so
# the fault build's tag goes through GOFLAGS.
.PHONY: lint
lint: ## gofmt, go vet, staticcheck and unparam (also of the container helper's module)
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	$(GO) vet $(CHAOS_TAGS) ./internal/chaos/... ./internal/fault/
	$(GO) run $(STATICCHECK) $(PKGS)
	$(GO) run $(STATICCHECK) $(CHAOS_TAGS) ./internal/chaos/... ./internal/fault/
	$(GO) run $(UNPARAM) $(PKGS)
	GOFLAGS="$$($(GO) env GOFLAGS) -tags=sagaflow_faults" $(GO) run $(UNPARAM) ./internal/chaos/... ./internal/fault/
	cd $(PGCONTAINER) && $(GO) vet ./... && $(GO) run $(STATICCHECK) ./... && $(GO) run $(UNPARAM) ./...

.PHONY: bench
bench: ## engine vs raw PostgreSQL, relay vs raw kafka-go: throughput and latency, same machine, same run
	$(GO) test -run '^$$' -bench 'StepThroughput|StepLatency|ConcurrencyKeyOverhead|PauseTriggerOverhead|StatementWatchOverhead' -benchtime=6000x -count=3 ./saga/
	$(GO) test -run '^$$' -bench 'ParallelVsSequential' -benchtime=20x -count=3 ./saga/
	$(GO) test -run '^$$' -bench 'RelayThroughput|CommitToKafkaLatency' -benchtime=20000x -count=3 ./relay/

.PHONY: bench/compare
bench/compare: ## sagaflow beside River, Temporal's dev server, Watermill and raw pgx (~21 min): docs/bench/results.json and PNGs
	cd bench && (./install-temporal.sh || echo "bench: Temporal CLI not built; its runs will report why")
	cd bench && $(GO) run . compare -out ../docs/bench/results.json
	cd bench && $(GO) run . plot -in ../docs/bench/results.json -out ../docs/bench

.PHONY: bench/quick
bench/quick: ## a short bench/compare (~4 min), report in bench/results-quick.json
	cd bench && $(GO) run . compare -quick -out results-quick.json

.PHONY: bench/waits
bench/waits: ## sagas that wait (~4-8 min): 100k sleepers vs none, timer lateness at 1,000/s, signal latency at half of peak
	cd bench && $(GO) run . waits -reps 2 -out results-waits.json

.PHONY: bench/test
bench/test: ## tests and vet of the benchmark module
	cd bench && $(GO) vet ./... && $(GO) test ./...

.PHONY: db/sql
db/sql: ## print the migrations' SQL for SCHEMA (default sagaflow), for your own migration tool
	@$(GO) run ./internal/cmd/printsql -schema "$${SCHEMA:-sagaflow}"
