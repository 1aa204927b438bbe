# Shared by hack/build-binaries.sh and hack/build-node.sh, which source this file after defining
# log and die. Not a script of its own.

# find_go: set GO (from $GO, `go` on PATH or /usr/local/go/bin/go) and GO_VERSION, or die.
find_go() {
  GO=${GO:-}
  if [[ -z "${GO}" ]]; then
    if command -v go >/dev/null 2>&1; then
      GO=$(command -v go)
    elif [[ -x /usr/local/go/bin/go ]]; then
      GO=/usr/local/go/bin/go
    else
      die "the Go toolchain was not found (looked for 'go' on PATH and /usr/local/go/bin/go). Install Go >= 1.26 (https://go.dev/dl/) or set GO=/path/to/go."
    fi
  fi
  GO_VERSION=$("${GO}" env GOVERSION 2>/dev/null) || die "'${GO} env GOVERSION' failed; is ${GO} a working Go toolchain?"
  log "using ${GO} (${GO_VERSION})"
}

# take_build_lock DIR KEY: create DIR and hold DIR/.lock on fd 9 until the script exits, so two
# builds of the same cache entry (two clusters started at once) run one after the other. The
# caller checks again afterwards whether the other build already produced everything.
take_build_lock() {
  mkdir -p "$1" || die "cannot create cache directory $1"
  command -v flock >/dev/null 2>&1 || return 0
  exec 9>"$1/.lock"
  if ! flock -n 9; then
    log "another build of $2 is running; waiting for it to finish..."
    flock 9
  fi
}
