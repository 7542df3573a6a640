# Everyday commands. .ci/run calls these targets, so CI and a laptop run the
# same thing.

# buf and the protoc plugins are pinned in tools/go.mod, apart from the
# service's own dependencies.
BUF := go tool -modfile=tools/go.mod buf

.PHONY: dev test fuzz generate check-generated lint bench bench-quick bench-sources build schema \
	release release-check image breaking update-contract helm-lint

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

# The many-sources workloads of docs/benchmark.md (issue #26): 20 source
# databases behind one serve (one heavy, 19 light; with the single-source
# steady arm they compare with), then 50 idle ones. About two minutes on 2
# cores. They stay out of bench and bench-quick: they create 70 databases
# and the server holds about 5 connections per source (about 250 at once
# with 50 sources: PostgreSQL's max_connections must leave room for that).
bench-sources: build
	cd bench && go run ./cmd/outboxd-bench --server-binary ../bin/outboxd --workload sources,idle-sources

build:
	go build -o bin/outboxd ./cmd/outboxd

# Release binaries in dist/: static (no cgo) for linux/amd64 and linux/arm64,
# -trimpath and version control stamping on (whatever GOFLAGS says), so a
# binary reports its version, commit and commit time (`outboxd version`)
# and two builds of one commit are byte for byte the same. SHA256SUMS
# lists their checksums.
RELEASE_PLATFORMS := linux/amd64 linux/arm64
release:
	rm -rf dist && mkdir -p dist
	@set -e; for p in $(RELEASE_PLATFORMS); do \
		os=$${p%/*}; arch=$${p#*/}; echo "build dist/outboxd-$$os-$$arch"; \
		CGO_ENABLED=0 GOOS=$$os GOARCH=$$arch go build -trimpath -buildvcs=true -ldflags='-s -w' \
			-o dist/outboxd-$$os-$$arch ./cmd/outboxd; \
	done
	cd dist && sha256sum outboxd-* > SHA256SUMS && cat SHA256SUMS

# CI's check of `make release`: the checksums verify, the binaries are
# static, the native one names this commit, and a build of the same commit
# from another folder has the same checksums (reproducible).
# Run it in a clone: Go stamps version control information only where .git
# is a directory, so a binary built in a git worktree (.git is a file) says
# "commit unknown" and this check fails there.
release-check: release
	cd dist && sha256sum --check --quiet SHA256SUMS
	@for f in dist/outboxd-*; do \
		if readelf -l $$f | grep -q 'Requesting program interpreter'; then echo "$$f is not static"; exit 1; fi; \
	done
	@v=$$(dist/outboxd-linux-$$(go env GOARCH) version); echo "$$v"; \
		case "$$v" in *"commit $$(git rev-parse HEAD)"*) ;; *) echo "version does not name commit $$(git rev-parse HEAD)"; exit 1;; esac
	@tmp=$$(mktemp -d); trap 'rm -rf $$tmp' EXIT; \
		git clone --quiet . $$tmp/outboxd && git -C $$tmp/outboxd checkout --quiet $$(git rev-parse HEAD) && \
		$(MAKE) --no-print-directory -C $$tmp/outboxd release >/dev/null && \
		diff dist/SHA256SUMS $$tmp/outboxd/dist/SHA256SUMS && echo "release is reproducible: same checksums from $$tmp"

# The container image (Containerfile) from dist/, with buildah.
IMAGE ?= localhost/outboxd:dev
image: release
	cp /etc/ssl/certs/ca-certificates.crt dist/
	buildah build --timestamp=0 --build-arg=TARGETARCH=$$(go env GOARCH) -f Containerfile -t $(IMAGE) dist

# The gRPC contract may only grow: buf breaking against the checked-in
# image of outbox.v1 (contract/outbox.v1.binpb). Update the baseline only
# deliberately, for a release: make update-contract.
breaking:
	$(BUF) breaking --against contract/outbox.v1.binpb

update-contract:
	$(BUF) build --exclude-source-info -o contract/outbox.v1.binpb

# helm is pinned as a Go tool in tools/helm/go.mod (apart from buf's
# module, whose dependencies it would otherwise move).
HELM := go tool -modfile=tools/helm/go.mod helm
helm-lint:
	$(HELM) lint --strict deploy/helm/outboxd
	$(HELM) lint --strict deploy/helm/outboxd --values deploy/helm/outboxd/values-everything.yaml
