# Shared by hack/build-binaries.sh, hack/build-node.sh and hack/build-images.sh, which source
# this file after defining log and die. Not a script of its own.
#
# The Go build steps below work on the sourcing script's variables: HACK_DIR, OUT_DIR (the cache
# entry), BIN_DIR (where its binaries go), BINARIES (every file of BIN_DIR it makes), FORCE (1:
# rebuild), and, once begin_work_dir ran, WORK_DIR, STAGE_DIR and START_ALL; GO (find_go).

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
# runc, iptables, conntrack: containerd and kube-proxy; ip: the node's routes; nft: the NetworkPolicy
# enforcer's nftables table (checked at start, deleted by `down` if left); busybox: the node
# tier's test image (a static build: the image holds nothing else).
NODE_HOST_NEEDS=(runc:runc iptables:iptables conntrack:conntrack ip:iproute2 nft:nftables
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

# parse_build_args HELP_LINES [ARG]: the build scripts' one optional argument. --print-bin-dir
# prints BIN_DIR and exits; --check exits with the status of the script's is_built function;
# --force sets FORCE=1 (else 0); -h/--help prints lines HELP_LINES (sed range) of the script's
# header comment.
parse_build_args() {
  FORCE=0
  case "${2:-}" in
    --print-bin-dir) echo "${BIN_DIR}"; exit 0 ;;
    --check) is_built; exit $? ;;
    --force) FORCE=1 ;;
    "") ;;
    -h|--help) sed -n "$1p" "${BASH_SOURCE[-1]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument: $2 (try --help)" ;;
  esac
}

# have_all NAME...: every NAME (a path under BIN_DIR) is an executable there.
have_all() {
  local b
  for b in "$@"; do
    [[ -x "${BIN_DIR}/${b}" ]] || return 1
  done
}

# needs_build NAME...: whether a step must run: always with --force, else while a NAME is missing.
needs_build() {
  [[ ${FORCE} -eq 1 ]] && return 0
  ! have_all "$@"
}

# begin_work_dir: WORK_DIR under OUT_DIR (removed when the script exits), STAGE_DIR inside it, and
# the Go environment of every step: static binaries, never a go.work from the caller's directory.
begin_work_dir() {
  WORK_DIR=$(mktemp -d "${OUT_DIR}/build.XXXXXX")
  trap 'rm -rf "${WORK_DIR}"' EXIT
  STAGE_DIR="${WORK_DIR}/out"
  mkdir -p "${STAGE_DIR}" "${BIN_DIR}"
  export CGO_ENABLED=0
  export GOWORK=off
  START_ALL=${SECONDS}
}

# step_done START: the step that began at SECONDS=START is done.
step_done() {
  log "  done in $(( SECONDS - $1 ))s"
}

# retry CMD...: run a go command, once more if it fails (module proxy hiccups); the Go
# build cache keeps what was compiled, so the second try resumes where the first stopped.
retry() {
  "$@" && return 0
  log "  failed; retrying once..."
  "$@"
}

# install_staged DEST NAME...: move freshly built binaries from STAGE_DIR into DEST atomically.
install_staged() {
  local dest=$1 b
  shift
  for b in "$@"; do
    [[ -x "${STAGE_DIR}/${b}" ]] || die "build did not produce ${b}"
    mv -f "${STAGE_DIR}/${b}" "${dest}/${b}"
  done
}

# go_install NAME VERSION ESTIMATE DEST PKG...: `go install pkg@version` for modules without
# replace directives (kwok, helm, containerd, the CNI plugins, CoreDNS), each binary into DEST;
# LDFLAGS_EXTRA (optional) is added to the linker flags.
go_install() {
  local name=$1 version=$2 estimate=$3 dest=$4 t=${SECONDS} p bins=()
  shift 4
  log "building ${name} ${version} (first run only, ${estimate})..."
  for p in "$@"; do
    (
      cd "${WORK_DIR}"
      GOFLAGS='' GOBIN="${STAGE_DIR}" retry "${GO}" install -trimpath -ldflags="-s -w ${LDFLAGS_EXTRA:-}" "${p}@${version}"
    ) || die "building ${p}@${version} failed (see the go output above)"
    bins+=("${p##*/}")
  done
  install_staged "${dest}" "${bins[@]}"
  step_done "${t}"
}

# build_kubernetes NOTE NAME...: k8s.io/kubernetes/cmd/NAME at K8S_VERSION, version stamped in
# (`kubectl version` shows it; helm's kubeVersion checks need it), into BIN_DIR; NOTE is the
# progress line's remark. k8s.io/kubernetes points its staging modules at ./staging/..., which a
# dependent module cannot see: a wrapper go.mod replaces each with the published k8s.io/<name>
# module of K8S_STAGING_VERSION. Both scripts write the same wrapper, so the control plane's Go
# module and build caches serve the node's kubelet and kube-proxy too.
build_kubernetes() {
  local note=$1
  shift
  needs_build "$@" || return 0
  local t=${SECONDS} dir="${WORK_DIR}/kubernetes" what modfile staging minor ldflags pkgs=() b m
  what=$(printf '%s, ' "$@")
  what=${what%, }
  log "building ${what} ${K8S_VERSION} (${note})..."
  mkdir -p "${dir}"
  modfile=$(cd "${dir}" && GOFLAGS='' retry "${GO}" mod download -json "k8s.io/kubernetes@${K8S_VERSION}" \
    | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p') \
    || die "downloading k8s.io/kubernetes@${K8S_VERSION} from the module proxy failed"
  [[ -f "${modfile}" ]] || die "could not locate go.mod of k8s.io/kubernetes@${K8S_VERSION}"
  staging=$(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/.*#\1#p' "${modfile}")
  [[ -n "${staging}" ]] || die "found no staging replace directives in ${modfile}"
  {
    printf 'module diloco.local/build/kubernetes\n\ngo 1.26\n\nrequire k8s.io/kubernetes %s\n\nreplace (\n' "${K8S_VERSION}"
    for m in ${staging}; do
      printf '\t%s => %s %s\n' "${m}" "${m}" "${K8S_STAGING_VERSION}"
    done
    printf ')\n'
  } > "${dir}/go.mod"
  minor=${K8S_VERSION#v*.}
  minor=${minor%%.*}
  ldflags="-s -w"
  for m in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X ${m}.gitVersion=${K8S_VERSION} -X ${m}.gitMajor=1 -X ${m}.gitMinor=${minor}"
    ldflags+=" -X ${m}.gitTreeState=clean -X ${m}.gitCommit=${K8S_VERSION}"
  done
  for b in "$@"; do
    pkgs+=("k8s.io/kubernetes/cmd/${b}")
  done
  (
    cd "${dir}"
    GOFLAGS=-mod=mod retry "${GO}" build -trimpath -ldflags="${ldflags}" -o "${STAGE_DIR}/" "${pkgs[@]}"
  ) || die "building ${what} ${K8S_VERSION} failed (see the go output above)"
  install_staged "${BIN_DIR}" "$@"
  step_done "${t}"
}

# finish_build WHAT: check that every one of BINARIES is there, record the versions beside them,
# and print BIN_DIR as the last line of stdout (what the callers read).
finish_build() {
  have_all "${BINARIES[@]}" || die "some binaries are missing from ${BIN_DIR} after the build"
  cp "${HACK_DIR}/versions.env" "${OUT_DIR}/versions.env"
  log "all ${1} built in $(( SECONDS - START_ALL ))s"
  echo "${BIN_DIR}"
}
