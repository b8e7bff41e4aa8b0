#!/usr/bin/env bash
# `make test-image`: builds deploy/Dockerfile with buildah and runs the image as
# the chart runs it (scripts/image_smoke.py). No container registry is reached:
# the Dockerfile's base (PYTHON_IMAGE) is stood in for by Debian's python3 on a
# minimal Debian of this machine's release (mmdebstrap, from the machine's own
# apt sources), made once and cached with the image storage under
# $KVWATCH_CACHE_DIR/image (by default ~/.cache/kvwatch/image).
# Extra arguments go to image_smoke.py.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
for tool in buildah podman mmdebstrap runc; do command -v "$tool" >/dev/null || need+=("$tool"); done
if [ ${#need[@]} -gt 0 ]; then
    sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "test-image: installing Debian packages: ${need[*]}"
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

python=${PYTHON:-.venv/bin/python}
cache=${KVWATCH_CACHE_DIR:-$HOME/.cache/kvwatch}/image
suite=$(. /etc/os-release && echo "$VERSION_CODENAME")
base=localhost/kvwatch-base:$suite
# One tag: the image of the commit before becomes dangling and is pruned below.
image=localhost/kvwatch:test-image
# Storage of its own under the cache: a cold run starts from nothing. overlay
# where the kernel has it (vfs copies every layer: 15 s per container here).
driver=${KVWATCH_IMAGE_STORAGE_DRIVER:-overlay}
store=(--root "$cache/storage" --runroot "$cache/run" --storage-driver "$driver")
mkdir -p "$cache/base"
t0=$(date +%s)

# The stand-in for python:3.X-slim: Debian's python3 with pip in a venv at
# /usr/local, where the pinned image has its interpreter and pip.
if ! buildah "${store[@]}" inspect --type image "$base" >/dev/null 2>&1; then
    if [ ! -s "$cache/base/rootfs.tar" ]; then
        sources=()
        for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
            [ -s "$f" ] && grep -qv '^\s*\(#\|$\)' "$f" && sources+=("$f")
        done
        mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
            "$suite" "$cache/base/rootfs.tar.part" "${sources[@]}"
        mv "$cache/base/rootfs.tar.part" "$cache/base/rootfs.tar"
    fi
    printf '%s\n' 'FROM scratch' 'ADD rootfs.tar /' 'RUN python3 -m venv /usr/local' 'ENV LANG=C.UTF-8' \
        'CMD ["python3"]' > "$cache/base/Containerfile"
    buildah "${store[@]}" bud --quiet --isolation chroot -f "$cache/base/Containerfile" -t "$base" "$cache/base"
fi
t1=$(date +%s)

# The builder stage fetches kvwatch's dependencies with pip: through this
# machine's pip configuration and certificates, as every other pip here does.
# No --layers: buildah 1.28 then fails a RUN --mount from a builder stage it
# took from its cache ("couldn't find .../merged/wheels"), so both stages are
# built every time (the base is what is cached).
mounts=()
for f in /etc/pip.conf "${PIP_CERT:-}" /etc/ssl/certs/ca-certificates.crt; do
    [ -n "$f" ] && [ -f "$f" ] && mounts+=(-v "$f:$f:ro")
done
version=$("$python" -c 'import kvwatch; print(kvwatch.__version__)')
buildah "${store[@]}" bud --isolation chroot --format docker "${mounts[@]}" \
    --build-arg "PYTHON_IMAGE=$base" --build-arg "VERSION=$version" \
    --build-arg "REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
    -f deploy/Dockerfile -t "$image" .
t2=$(date +%s)

status=0
"$python" scripts/image_smoke.py --image "$image" --version "$version" \
    --root "$cache/storage" --runroot "$cache/run" --storage-driver "$driver" "$@" || status=$?
# The cache keeps the base and this image; the image before it, left untagged,
# goes, so the folder does not grow.
buildah "${store[@]}" rmi --prune >/dev/null 2>&1 || true
echo "test-image: base $((t1 - t0)) s, build $((t2 - t1)) s, smoke $(( $(date +%s) - t2 )) s (exit $status)"
exit "$status"
