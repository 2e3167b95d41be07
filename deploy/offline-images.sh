#!/usr/bin/env bash
# Builds the compose file's two images with no image registry and no PyTorch
# wheel index, from the repository's Dockerfiles as they are:
#   1. the base image, by deploy/offline-base-image.sh (kept once made);
#   2. torch (the version pyproject.toml pins) and its dependencies, fetched by
#      this machine's pip as its configuration says (a local wheel directory, a
#      mirror), laid out as a simple index and served on 127.0.0.1 for the
#      worker's build (TORCH_INDEX_URL; both builds run on the host network);
#   3. `docker build` of frontend/Dockerfile and worker/Dockerfile.
# The builds still take the other wheels from PyPI and the worker's g++ from the
# Debian mirror (the base image carries this machine's CA certificates, so a
# TLS-inspecting proxy on the way is trusted).
#
#   sudo deploy/offline-images.sh            # or: sudo make offline-images
#   MODEL_ID=synthetic docker compose up     # uses the images, builds nothing
#
# FRONTEND_IMAGE and WORKER_IMAGE (default: the compose file's names) tag them;
# WHEELHOUSE (default ~/.cache/minibatch-llm/wheelhouse) keeps the downloaded wheels;
# PYTHON is the interpreter whose pip fetches them (default .venv/bin/python).
# Where a torch index is reachable, TORCH_INDEX_URL=URL builds from it instead.
# Exit status 3: this machine's pip finds no CPU build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."

FRONTEND_IMAGE=${FRONTEND_IMAGE:-minibatch-llm-frontend}
WORKER_IMAGE=${WORKER_IMAGE:-minibatch-llm-worker}
WHEELHOUSE=${WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/minibatch-llm/wheelhouse}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

deploy/offline-base-image.sh

# Both on the host's network: the worker's build reaches the local index on
# 127.0.0.1, and neither needs the engine's NAT to reach PyPI and the mirror.
build() {  # image dockerfile docker-build-options...
    local image=$1 dockerfile=$2 started
    shift 2
    started=$(date +%s)
    docker build --network host --file "$dockerfile" --tag "$image" "$@" . >"$LOG" 2>&1 \
        || { tail -40 "$LOG" >&2; echo "building $image failed" >&2; exit 1; }
    echo "$image: built in $(( $(date +%s) - started )) s," \
        "$(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1 / 1e6}')"
}
LOG=$(mktemp)
INDEX=
server_pid=
cleanup() {
    [ -z "$server_pid" ] || kill "$server_pid" 2>/dev/null
    rm -rf "$LOG" ${INDEX:+"$INDEX"}
}
trap cleanup EXIT

# Where a torch index is reachable, name it: no local index is needed.
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    build "$FRONTEND_IMAGE" frontend/Dockerfile
    build "$WORKER_IMAGE" worker/Dockerfile --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL"
    exit 0
fi

# The torch that this machine's pip would install must be a CPU build (a local
# version such as +cpu), not PyPI's CUDA one with its GBs of CUDA wheels.
torch_pin=$(grep -oE '"torch==[^"]+"' pyproject.toml | tr -d '"')
torch_version=$("$PYTHON" -m pip install --dry-run --ignore-installed --no-deps --quiet \
    --report - "$torch_pin" 2>/dev/null \
    | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])' 2>/dev/null) \
    || torch_version=none
case "$torch_version" in
    *+cpu*) ;;
    *) echo "this machine's pip finds no CPU build of $torch_pin (it finds: $torch_version);" \
            "give it a wheel directory (PIP_FIND_LINKS), or set TORCH_INDEX_URL to a torch index" >&2
       exit 3 ;;
esac
mkdir -p "$WHEELHOUSE"
"$PYTHON" -m pip download --quiet --only-binary=:all: --dest "$WHEELHOUSE" "$torch_pin" 2>&1 \
    | grep -v '^WARNING: Location' >&2 || true
ls "$WHEELHOUSE/torch-$torch_version"*.whl >/dev/null  # the download worked

# A PEP 503 simple index: one directory per project, its wheels linked in.
INDEX=$(mktemp -d)
for wheel in "$WHEELHOUSE"/*.whl; do
    file=$(basename "$wheel")
    project=$(echo "${file%%-*}" | tr 'A-Z_.' 'a-z--')
    mkdir -p "$INDEX/simple/$project"
    ln -s "$wheel" "$INDEX/simple/$project/$file"
done
port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$PYTHON" -m http.server --bind 127.0.0.1 --directory "$INDEX" "$port" >/dev/null 2>&1 &
server_pid=$!
for _ in $(seq 50); do
    "$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/simple/')" \
        2>/dev/null && break
    sleep 0.1
done

build "$FRONTEND_IMAGE" frontend/Dockerfile
build "$WORKER_IMAGE" worker/Dockerfile --build-arg "TORCH_INDEX_URL=http://127.0.0.1:$port/simple"
