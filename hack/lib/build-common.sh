# Shared by hack/build-binaries.sh, hack/build-node.sh and hack/build-images.sh, which source
# this file after defining log and die. Not a script of its own.

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

# What the test tiers need from the host, as NEED:PACKAGE (NEED is a command looked up on PATH or
# an absolute path; PACKAGE the Debian package that provides it), one list per build step, which
# installs what is missing: NODE_HOST_NEEDS by hack/build-node.sh (`make node`), IMAGE_HOST_NEEDS
# by hack/build-images.sh (`make images`). A fresh machine of this project's kind has none of
# these packages but iproute2 (ip), coreutils, util-linux and python3; the tests that look a need
# up fail naming the make target that installs it. tests/unit/test_host_needs.py checks every
# program and file the tiers look up against these lists.
# runc, iptables, conntrack: containerd and kube-proxy; ip: the node's routes; busybox: the node
# tier's test image (a static build: the image holds nothing else).
NODE_HOST_NEEDS=(runc:runc iptables:iptables conntrack:conntrack ip:iproute2
  /bin/busybox:busybox-static)
# buildah, debootstrap: the image builds; umoci and runc: tests/node/test_images.py unpacks and runs
# the archives.
IMAGE_HOST_NEEDS=(buildah:buildah debootstrap:debootstrap umoci:umoci runc:runc chroot:coreutils
  sha256sum:coreutils flock:util-linux python3:python3)

# missing_tools NEED:PACKAGE...: print the Debian packages whose NEED is missing: a command not on
# PATH (sbin directories included: runc and iptables live there), or an absolute path that is not
# there.
missing_tools() {
  local t need
  for t in "$@"; do
    need=${t%%:*}
    if [[ ${need} == /* ]]; then
      [[ -e ${need} ]] || printf '%s\n' "${t##*:}"
    else
      PATH="${PATH}:/usr/sbin:/sbin" command -v "${need}" >/dev/null 2>&1 || printf '%s\n' "${t##*:}"
    fi
  done
}

# install_debian_tools CMD:PACKAGE...: install the packages whose command is missing with apt-get
# (root only: a fresh machine of this project's kind has none of them), else say what is missing.
install_debian_tools() {
  local missing
  mapfile -t missing < <(missing_tools "$@")
  [[ ${#missing[@]} -eq 0 ]] && return 0
  if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    die "missing host packages: ${missing[*]} (install them, e.g. 'apt-get install ${missing[*]}')"
  fi
  log "installing Debian packages: ${missing[*]}..."
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2 \
    || { apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2; } \
    || die "apt-get install ${missing[*]} failed"
}
