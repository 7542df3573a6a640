# Everyday commands. .ci/run calls these targets, so CI and a laptop run the
# same thing.

# buf and the protoc plugins are pinned in tools/go.mod, apart from the
# service's own dependencies.
BUF := go tool -modfile=tools/go.mod buf

.PHONY: dev test fuzz generate check-generated lint bench bench-quick build schema

# Run outboxd against a PostgreSQL found or started by internal/devdb. The
# binary is built first and run by exec rather than by `go run`: on Ctrl-C,
# go run exits 1 whatever its program does (cmd/go marks an interrupted run
# failed), so make printed "Error 1" after a clean stop. outboxd itself
# exits 0 when SIGINT or SIGTERM asked it to stop.
dev: build
	exec ./bin/outboxd dev

# The benchmark is a module of its own (bench/), which ./... does not reach.
test:
	go test -race -count=1 -timeout 12m ./...
	cd bench && go test -race -count=1 -timeout 5m ./...

# A short run of every fuzz target (go test -fuzz takes one target per run);
# their seed corpora run with every `make test` anyway. Each target runs a
# count of inputs (about 8s each on a 2-core machine), not a duration: with
# a duration, Go's fuzz coordinator (before Go 1.27, golang/go#75804) can
# fail a target with a bare "context deadline exceeded" when the time is up
# while a worker is mid-input, and the slow targets (a real server per
# input) hit it. FUZZTIME=5m (or 100000x) overrides every target's budget
# for a longer hunt.
FUZZTIME ?=
FUZZ_TARGETS := \
	./internal/leasetoken:FuzzVerify:200000x \
	./internal/auth:FuzzParseTokens:25000x \
	./internal/auth:FuzzParseAuthorization:40000x \
	./internal/auth:FuzzGlobMatch:40000x \
	./relay/sink:FuzzSubjectTokenRoundTrip:12000x \
	./server:FuzzAck:10000x \
	./server:FuzzSubscribeRequest:4000x
fuzz:
	@set -e; for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; rest=$${t#*:}; name=$${rest%%:*}; budget=$${rest#*:}; \
		budget=$(or $(FUZZTIME),$$budget); \
		echo "fuzz $$name ($$pkg, $$budget)"; \
		go test -run '^$$' -fuzz "^$$name\$$" -fuzztime $$budget $$pkg; \
	done

# Rewrite migrations/testdata/schema.sql, the reviewed snapshot of the schema
# the migrations produce (make test fails while it is stale).
schema:
	UPDATE_SCHEMA_SNAPSHOT=1 go test -count=1 -run '^TestSchemaSnapshot$$' ./migrations/

# Regenerate gen/ from proto/ (buf.gen.yaml cleans gen/ first).
generate:
	$(BUF) generate

# Fail if gen/ differs from what `make generate` produces; CI runs this so
# that proto changes cannot be merged without their generated code.
check-generated: generate
	@if ! git diff --quiet -- gen/ || [ -n "$$(git ls-files --others --exclude-standard -- gen/)" ]; then \
		git status --short -- gen/; \
		echo "gen/ is stale: run make generate"; \
		exit 1; \
	fi

# gofmt covers tracked and new (not ignored) Go files outside gen/; gen/ is
# checked by check-generated instead.
lint:
	$(BUF) lint
	$(BUF) format -d --exit-code
	@out=$$(gofmt -l $$(git ls-files --cached --others --exclude-standard -- '*.go' ':(exclude)gen/')); \
	if [ -n "$$out" ]; then echo "gofmt would reformat these files (run gofmt -w):"; echo "$$out"; exit 1; fi
	go vet ./...
	cd bench && go vet ./...

# The benchmark of docs/benchmark.md, from its own module (bench/), against
# $DATABASE_URL or the local PostgreSQL. It builds bin/outboxd first and runs
# that binary's serve command as the server. The standard set takes about 15
# minutes on 2 cores; BENCHMARKS.md records the latest run. bench-quick runs a
# reduced set (a few minutes) and writes nothing but its table.
bench: build
	cd bench && go run ./cmd/outboxd-bench --server-binary ../bin/outboxd --json ../docs/bench.json --plot ../docs/bench.png

bench-quick: build
	cd bench && go run ./cmd/outboxd-bench --server-binary ../bin/outboxd --quick

build:
	go build -o bin/outboxd ./cmd/outboxd
