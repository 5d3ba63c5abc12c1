#!/usr/bin/env bash
# Builds the Temporal CLI (whose `server start-dev` is the Temporal
# development server, state in SQLite) into bench/.bin with go install.
# v1.5.1 is the newest release the module proxy serves that go install can
# build: v1.9.1's go.mod has a replace directive (./cliext, a nested module
# the proxy does not serve), which go install refuses.
# The build is heavy (a few minutes on 2 cores, ~250 MB binary); it is
# skipped when the binary is already there.
set -euo pipefail
cd "$(dirname "$0")"
version="${TEMPORAL_CLI_VERSION:-v1.5.1}"
if [ -x .bin/temporal ]; then
  exit 0
fi
mkdir -p .bin
echo "building the Temporal CLI $version into bench/.bin (a few minutes)..." >&2
GOBIN="$PWD/.bin" go install "github.com/temporalio/cli/cmd/temporal@$version"
