#!/usr/bin/env bash
# Build the operator and trainer images from the project's Dockerfile without a Docker daemon:
# buildah (storage under a cache directory, chroot isolation), a base image made here with
# debootstrap (no registry is needed), torch from local wheels or PyPI. Writes OCI archives that
# `ctr images import` or `skopeo copy oci-archive:...` load:
#   ${DILOCO_IMAGES_CACHE:-$HOME/.cache/diloco-operator/images}/<key>/{operator,trainer}.tar
# <key> hashes the build context (Dockerfile, .dockerignore, pyproject.toml, LICENSE, trainer/,
# operator/), this script, the base image's recipe and versions, and the torch source. README.md
# is left out on purpose: it only reaches the wheel's metadata, and every edit would rebuild both.
# When both archives of the key exist the script returns at once.
#
# Usage (as root):
#   hack/build-images.sh              build what is missing; print the archive dir as last line
#   hack/build-images.sh --check      exit 0 if both archives of the current key exist, 1 otherwise
#   hack/build-images.sh --print-dir  print the archive dir of the current key (builds nothing)
#   hack/build-images.sh --force      rebuild the operator and trainer images
# Environment:
#   TORCH_WHEELS=DIR   local torch wheels (unset or empty: PyPI; .ci/run passes the CI machine's)
#   TORCH_VARIANT, TORCH_INDEX_URL  the Dockerfile's build arguments, when torch comes from an
#                      index (with TORCH_WHEELS=): cpu, cu124, ... or an index URL
#   DILOCO_IMAGE_TAG   tag of the images (default: dev)
#   DILOCO_BUILDAH_ROOT  buildah's storage (default: $HOME/.cache/diloco-operator/buildah)
set -euo pipefail

HACK_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "${HACK_DIR}/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=versions.env disable=SC1091
source "${HACK_DIR}/versions.env"

CACHE_HOME=${HOME:?HOME is not set}/.cache/diloco-operator
CACHE_ROOT=${DILOCO_IMAGES_CACHE:-${CACHE_HOME}/images}
STORAGE=${DILOCO_BUILDAH_ROOT:-${CACHE_HOME}/buildah}
TAG=${DILOCO_IMAGE_TAG:-dev}
BASE_IMAGE="localhost/diloco-base:${DEBIAN_SUITE}-py${BASE_PYTHON#python}"
OPERATOR_IMAGE="localhost/diloco-operator:${TAG}"
TRAINER_IMAGE="localhost/diloco-trainer:${TAG}"
# Where RUN sees TORCH_WHEELS: a directory every Debian image has empty, so no mount point is
# left behind in the image (buildah creates a missing one and keeps it).
TORCH_MOUNT=/mnt

log() { printf '[build-images] %s\n' "$*" >&2; }
die() { printf '[build-images] ERROR: %s\n' "$*" >&2; exit 1; }
# shellcheck source=lib/build-common.sh disable=SC1091
source "${HACK_DIR}/lib/build-common.sh"

# --- torch: a local wheel directory or PyPI ------------------------------------------------
TORCH_WHEELS=${TORCH_WHEELS:-}
TORCH_WHEEL=""
if [[ -n "${TORCH_WHEELS}" ]]; then
  [[ -d "${TORCH_WHEELS}" ]] || die "TORCH_WHEELS=${TORCH_WHEELS} is not a directory"
  TORCH_WHEEL=$(find "${TORCH_WHEELS}" -maxdepth 1 -name 'torch-*-cp311-cp311-*linux*_x86_64.whl' \
    -printf '%f\n' | sort -V | tail -n 1)
  [[ -n "${TORCH_WHEEL}" ]] || die "no torch wheel for CPython 3.11 on Linux x86_64 in ${TORCH_WHEELS} (set TORCH_WHEELS= to use PyPI)"
  # torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl -> torch==2.13.0+cpu
  TORCH_SPEC="torch==$(cut -d- -f2 <<<"${TORCH_WHEEL}")"
else
  TORCH_SPEC=""  # the Dockerfile's default: pyproject.toml's range
fi

# --- cache keys ----------------------------------------------------------------------------
hash_files() { (cd "${REPO_DIR}" && sha256sum "$@") | sha256sum | cut -c1-16; }
BASE_KEY=$( { hash_files hack/images/base-rootfs.sh
              echo "${DEBIAN_SUITE} ${BASE_PYTHON} ${BASE_REVISION}"; } | sha256sum | cut -c1-16)
context_files() {
  (cd "${REPO_DIR}" && find Dockerfile .dockerignore pyproject.toml LICENSE trainer operator \
    -type f ! -path '*/__pycache__/*' ! -name '*.py[cod]' ! -path '*.egg-info/*' \
    ! -path '*/.pytest_cache/*' ! -path '*/.ruff_cache/*' | LC_ALL=C sort)
}
mapfile -t CONTEXT < <(context_files)
KEY=$( { hash_files "${CONTEXT[@]}" hack/build-images.sh
         echo "base=${BASE_KEY} torch=${TORCH_WHEEL:-pypi} variant=${TORCH_VARIANT:-} index=${TORCH_INDEX_URL:-} tag=${TAG}"; } \
       | sha256sum | cut -c1-16)
OUT_DIR="${CACHE_ROOT}/${KEY}"

cached() { [[ -s "${OUT_DIR}/operator.tar" && -s "${OUT_DIR}/trainer.tar" && -f "${OUT_DIR}/images.env" ]]; }
report() {
  log "images (OCI archives in ${OUT_DIR}):"
  log "  ${OPERATOR_IMAGE}  operator.tar $(du -h "${OUT_DIR}/operator.tar" | cut -f1)"
  log "  ${TRAINER_IMAGE}  trainer.tar $(du -h "${OUT_DIR}/trainer.tar" | cut -f1)"
  echo "${OUT_DIR}"
}

FORCE=0
case "${1:-}" in
  --print-dir) echo "${OUT_DIR}"; exit 0 ;;
  --check) cached; exit $? ;;
  --force) FORCE=1 ;;
  "") ;;
  -h|--help) sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument: $1 (try --help)" ;;
esac

if [[ ${FORCE} -eq 0 ]] && cached; then
  report
  exit 0
fi

# --- tools ---------------------------------------------------------------------------------
[[ $(id -u) -eq 0 ]] || die "run as root (debootstrap and buildah's chroot isolation need it)"
# A fresh machine of this project's kind has neither buildah nor debootstrap: install them
# (and umoci, with which tests/node/test_images.py unpacks the archives to run them with runc).
install_debian_tools "${IMAGE_HOST_NEEDS[@]}"

mkdir -p "${CACHE_ROOT}" "${STORAGE}"
exec 9>"${CACHE_ROOT}/.lock"
if ! flock -n 9; then
  log "another build is running; waiting for it to finish..."
  flock 9
fi
if [[ ${FORCE} -eq 0 ]] && cached; then
  report
  exit 0
fi

# vfs: works on any filesystem and inside containers; buildah's storage stays in the cache.
bh() {
  buildah --root "${STORAGE}/root" --runroot "${STORAGE}/run" \
    --storage-driver "${DILOCO_BUILDAH_DRIVER:-vfs}" "$@"
}
STARTED=$(date +%s)
elapsed() { echo "$(( $(date +%s) - $1 ))s"; }
LOG_DIR="${CACHE_ROOT}/logs"
mkdir -p "${LOG_DIR}"
# Run "$@" with its whole output in ${LOG_DIR}/STEP.log; lines matching PATTERN (the progress a
# person follows) also go to the terminal; on failure the log's tail does too.
logged() {
  local step=$1 pattern=$2 rc=0
  shift 2
  "$@" > "${LOG_DIR}/${step}.log" 2>&1 9>&- &
  local pid=$!
  tail -n +1 -F --pid "${pid}" "${LOG_DIR}/${step}.log" 2>/dev/null \
    | grep --line-buffered -E "${pattern}" \
    | sed -u -e 's/^\[build-images\] //' -e "s/^/[build-images] ${step}: /" >&2 || true
  wait "${pid}" || rc=$?
  if [[ ${rc} -ne 0 ]]; then
    tail -n 40 "${LOG_DIR}/${step}.log" | sed "s/^/[build-images] ${step}: | /" >&2
    die "${step} failed (exit ${rc}); whole log: ${LOG_DIR}/${step}.log"
  fi
}
# Hosts behind a TLS-inspecting proxy trust its CA in their own store: RUN steps get the host's
# store over the image's (mounted, never copied in; the base's pip reads the system store).
HOST_CA=${DILOCO_HOST_CA:-/etc/ssl/certs/ca-certificates.crt}
ca_args=()
[[ -s "${HOST_CA}" ]] && ca_args+=(--volume "${HOST_CA}:/etc/ssl/certs/ca-certificates.crt:ro")

# --- 1. the base image ---------------------------------------------------------------------
build_base() {
  local t0 work ctr mnt
  t0=$(date +%s)
  work=$(mktemp -d "${CACHE_ROOT}/base-XXXXXX")
  # --one-file-system: an interrupted debootstrap can leave proc or sys mounted inside.
  # shellcheck disable=SC2064
  trap "rm -rf --one-file-system '${work}'" RETURN
  log "base: building ${BASE_IMAGE} (debootstrap + ${BASE_PYTHON}; about 2 minutes)"
  logged base '^\[build-images\]' env DEBIAN_SUITE="${DEBIAN_SUITE}" BASE_PYTHON="${BASE_PYTHON}" \
    bash "${HACK_DIR}/images/base-rootfs.sh" "${work}/rootfs"
  ctr=$(bh from --quiet scratch)
  mnt=$(bh mount "${ctr}")
  cp -a "${work}/rootfs/." "${mnt}/"
  bh umount "${ctr}" >/dev/null
  bh config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env VIRTUAL_ENV=/opt/venv --env LANG=C.UTF-8 --cmd python3 \
    --os linux --arch amd64 \
    --label "io.diloco.base-key=${BASE_KEY}" \
    --label "org.opencontainers.image.description=Debian ${DEBIAN_SUITE} (debootstrap minbase) with ${BASE_PYTHON} in /opt/venv" \
    "${ctr}"
  bh commit --quiet --rm "${ctr}" "${BASE_IMAGE}" >/dev/null
  log "base: ${BASE_IMAGE} done in $(elapsed "${t0}")"
}
have_base_key=$(bh inspect --type image --format '{{index .OCIv1.Config.Labels "io.diloco.base-key"}}' \
  "${BASE_IMAGE}" 2>/dev/null || true)
if [[ "${have_base_key}" == "${BASE_KEY}" ]]; then
  log "base: ${BASE_IMAGE} is current (key ${BASE_KEY})"
else
  build_base
fi

# --- 2. operator and trainer from the Dockerfile -------------------------------------------
build_target() {
  local target=$1 image=$2 t0
  shift 2
  t0=$(date +%s)
  log "${target}: buildah bud --target ${target} -> ${image}"
  logged "${target}" '^\[[0-9]+/[0-9]+\] STEP|^STEP|^(Collecting|Successfully) ' \
    bh bud --isolation chroot --target "${target}" --tag "${image}" \
    --build-arg "PYTHON_IMAGE=${BASE_IMAGE}" "${ca_args[@]}" "$@" \
    -f "${REPO_DIR}/Dockerfile" "${REPO_DIR}"
  log "${target}: ${image} done in $(elapsed "${t0}")"
}
build_target operator "${OPERATOR_IMAGE}"
trainer_args=()
[[ -n "${TORCH_SPEC}" ]] && trainer_args+=(--build-arg "TORCH_SPEC=${TORCH_SPEC}")
for arg in TORCH_VARIANT TORCH_INDEX_URL; do
  [[ -n "${!arg:-}" ]] && trainer_args+=(--build-arg "${arg}=${!arg}")
done
if [[ -n "${TORCH_WHEEL}" ]]; then
  log "trainer: torch from ${TORCH_WHEELS}/${TORCH_WHEEL}"
  trainer_args+=(--volume "${TORCH_WHEELS}:${TORCH_MOUNT}:ro" --build-arg "TORCH_FIND_LINKS=${TORCH_MOUNT}")
else
  log "trainer: torch from ${TORCH_INDEX_URL:-${TORCH_VARIANT:-PyPI}} (${TORCH_SPEC:-the range in the Dockerfile})"
fi
build_target trainer "${TRAINER_IMAGE}" "${trainer_args[@]}"

# --- 3. OCI archives -----------------------------------------------------------------------
mkdir -p "${OUT_DIR}"
for pair in "operator:${OPERATOR_IMAGE}" "trainer:${TRAINER_IMAGE}"; do
  name=${pair%%:*} image=${pair#*:} t0=$(date +%s)
  layout="${OUT_DIR}/${name}.layout"
  rm -rf "${layout}" "${OUT_DIR}/${name}.tar.part"
  log "${name}: writing ${OUT_DIR}/${name}.tar"
  bh push --quiet "${image}" "oci:${layout}:${image}" >/dev/null
  # Name the image for `ctr images import` (io.containerd.image.name) beside the OCI ref name
  # (the full name too, for skopeo and umoci).
  python3 - "${layout}/index.json" "${image}" <<'PY'
import json, sys
path, name = sys.argv[1:]
with open(path) as f:
    index = json.load(f)
for manifest in index["manifests"]:
    manifest.setdefault("annotations", {})["io.containerd.image.name"] = name
with open(path, "w") as f:
    json.dump(index, f)
PY
  tar -C "${layout}" -cf "${OUT_DIR}/${name}.tar.part" oci-layout index.json blobs
  rm -rf "${layout}"
  mv "${OUT_DIR}/${name}.tar.part" "${OUT_DIR}/${name}.tar"
  log "${name}: archive done in $(elapsed "${t0}")"
done
cat > "${OUT_DIR}/images.env" <<EOF
OPERATOR_IMAGE=${OPERATOR_IMAGE}
TRAINER_IMAGE=${TRAINER_IMAGE}
BASE_IMAGE=${BASE_IMAGE}
TORCH=${TORCH_WHEEL:-${TORCH_INDEX_URL:-${TORCH_VARIANT:-pypi}}}
EOF
# The archives are the product: buildah's storage keeps only the base image (vfs stores every
# layer as a full copy), and the cache keeps the newest three keys.
bh rmi "${OPERATOR_IMAGE}" "${TRAINER_IMAGE}" >/dev/null
bh rmi --prune >/dev/null 2>&1 || true
find "${CACHE_ROOT}" -mindepth 1 -maxdepth 1 -type d -regextype egrep -regex '.*/[0-9a-f]{16}' \
  -printf '%T@ %p\n' | sort -rn | tail -n +4 | cut -d' ' -f2- | xargs -r rm -rf
log "all images built in $(elapsed "${STARTED}")"
report
