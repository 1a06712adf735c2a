# The rig's patched vLLM v0.30.0 as an image: built on a box with no GPU and no driver, run on the GPU host.
#
#   Route 1, the kernels of artifacts/ (./build.sh packed them): no compile, about 2 minutes
#     docker build --build-context ops="$PWD/artifacts" -t vllm:latest .
#   Route 2, ./build.sh inside the image: a compile takes 20-40 minutes and about 15 GB of build disk
#     docker build -t vllm:latest .          (a series of Python-only patches takes the official wheel's
#                                             kernels; --build-arg OPS_ROUTE=compile compiles anyway)
#
# No parser directive names a frontend image: one would make BuildKit fetch it from Docker Hub, which a
# mirror-only or air-gapped build box cannot reach; the built-in frontend reads all of this file.
#
# Both download vLLM v0.30.0 and the hash-pinned wheels, so the build needs the network. docker-compose.yml
# passes the `ops`, `uvcache` and `pipcache` contexts itself.

# The base: Debian 13 (trixie). `nox -s image` passes another where the builder has no route to a registry (the
# same trixie, made with debootstrap); a base must be trixie or newer (see below).
ARG BASE_IMAGE=debian:trixie-slim

# The named contexts default to these empty stages; `--build-context NAME=DIR` replaces a stage of its name.
FROM scratch AS ops
FROM scratch AS uvcache
FROM scratch AS pipcache

# The route-1 layer's cache key is the kernels themselves. buildah and podman key a RUN by its text and the
# layers before it, not by what a bound context holds: without this stage a rebuild after artifacts/ changed
# (or was emptied) reuses the old route-1 layer, old kernels and all. It copies the `ops` context (the stage is
# thrown away) and keeps its manifest and sha256 list, which name the tarball; copied in before route 1, that
# file changes whenever the kernels do. An empty context gives an empty key: route 2.
FROM ${BASE_IMAGE} AS opskey
COPY --from=ops . /ops/
RUN { cat /ops/manifest.toml /ops/ops.sha256 2>/dev/null || true; } > /ops.key

# Debian 13 (trixie): kernels built on Debian 13 need glibc 2.38, and bookworm's 2.36 cannot load them.
FROM ${BASE_IMAGE}

# Compile jobs of route 2; lower it when the compile runs out of RAM.
ARG MAX_JOBS=32
# GPU architectures: what route 2 compiles for, and what route 1 requires the tarball to hold.
ARG ARCH=8.6
# The ops step's route: auto takes the official wheel's kernels when the series touches no compiled input.
ARG OPS_ROUTE=auto
# Where the base comes from: the source series.toml records a tree for (git needs an [expected.git] entry).
ARG VLLM_SOURCE=sdist
# What the image serves on: cuda (the GPU host), or cpu (the CPU build, its kernels from artifacts-cpu/: the demo
# anywhere). Every step below reads it as the rig's DEVICE, so the tree, venv and kernels are that build's.
ARG DEVICE=cuda

SHELL ["/bin/bash", "-eo", "pipefail", "-c"]

# The build tools of step 1 (git, cc/c++, ccache), Python headers for the compile, zstd for the tarball,
# readelf (binutils) for the link check, libnuma1 (the CPU kernels load it from the system), and tini to pass
# Docker's SIGTERM on. DL3008 (pin apt versions) is ignored on purpose: trixie's security updates are wanted,
# and a pinned version leaves the mirror once it is superseded, which would break the build.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends binutils build-essential ca-certificates ccache git libnuma1 \
        python3 python3-dev python3-venv tini zstd \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/vllm
# Every RUN that downloads sources scripts/host-ca.sh: with the build secret `host_ca` (the host's CA store,
# for a TLS-inspecting proxy) pip, uv and requests trust it for that step; without it nothing changes.
COPY scripts/host-ca.sh scripts/

# cmake and ninja from PyPI at the versions the lock pins, and uv, in a venv of their own: Debian's Python
# refuses pip installs into the system. The user's caches (`pipcache`, `uvcache`) are bind mounts, which
# are read-only: what they hold is copied into the build's own cache mount, never the other way.
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,from=pipcache,target=/mnt/pipcache \
    --mount=type=secret,id=host_ca \
    . scripts/host-ca.sh \
    && cp -a --update=none /mnt/pipcache/. /root/.cache/pip/ \
    && python3 -m venv /opt/tools \
    && /opt/tools/bin/pip install --disable-pip-version-check cmake==4.4.5 ninja==1.13.2 uv==0.13.9 \
    && ln -s /opt/tools/bin/cmake /opt/tools/bin/ninja /opt/tools/bin/uv /usr/local/bin/

# Steps 1-5 read the wrappers, the series, the profiles and the rig's three lowest layers (base, facts, build:
# none of them imports a folder above it, tests/test_layers.py), so those come in first: an edit elsewhere under
# rig/ (start, the supervisor, the nodes) keeps the 7-9 GB venv layer below from the cache. The rest after it.
COPY build.sh noxfile.py pyproject.toml ./
COPY scripts/ scripts/
COPY patches/ patches/
COPY models/ models/
COPY rig/__init__.py rig/cli.py rig/
COPY rig/base/ rig/base/
COPY rig/facts/ rig/facts/
COPY rig/build/ rig/build/

# DEVICE picks the tree and venv: vllm/ and .venv/, or vllm-cpu/ and .venv-cpu/ with DEVICE=cpu. PACK=0: the
# image is the product, no artifacts/ inside it. uv copies out of its cache (a mount) and uses the image's
# CPython 3.13 rather than downloading one.
ENV DEVICE=${DEVICE} \
    CCACHE_DIR=/root/.cache/ccache \
    PACK=0 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never

# Steps 1-5: tools, the tree (v0.30.0 plus patches/), the venv with the hash-pinned runtime, and the
# toolchain, whose link-time libcuda.so.1 stub lets the kernels link with no driver in the build.
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=cache,target=/root/.cache/vllm-rig \
    --mount=type=bind,from=uvcache,target=/mnt/uvcache \
    --mount=type=secret,id=host_ca \
    . scripts/host-ca.sh \
    && cp -a --update=none /mnt/uvcache/. /root/.cache/uv/ \
    && ./build.sh --only tools,tree,venv,runtime,toolchain \
    && python3 -m rig.build.container target

COPY . .

# Route 1: the rig's verify (standard library only) computes this image's kernel target and checks the tarball
# against it in one process: its tree (OPS_OBJ), ARCH, CPython, CUDA and torch, its files against the
# precompiled kernels' list kept beside the series (patches/precompiled/), and every file's sha256, before it
# installs anything; a tarball from another tree stops the build naming the item. The kernels are then recorded
# as the ops step's products and vllm is installed editable without a compile. An empty `ops` context leaves
# the kernels to route 2.
COPY --from=opskey /ops.key /usr/local/share/rig/ops.key
RUN --mount=type=bind,from=ops,target=/ops \
    --mount=type=cache,target=/root/.cache/uv \
    --mount=type=secret,id=host_ca \
    . scripts/host-ca.sh \
    && if [ -z "$(find /ops -mindepth 1 -maxdepth 1 -print -quit)" ]; then \
        echo "route 2: the ops context is empty, so ./build.sh makes the kernels"; exit 0; fi \
    && python3 -m rig.build.container verify --artifacts /ops \
    && uv run --no-project --with-editable . python3 -m rig.build.container adopt --artifacts /ops

# Both routes: ./build.sh. After route 1 the ops step is current; route 2 makes the kernels here, compiled
# with MAX_JOBS, ARCH and ccache (or the official wheel's, as OPS_ROUTE allows). The install step's import
# check has no driver here, so it checks the link layer only and says so. The CMake build folder of a
# compile is not part of the image.
RUN --mount=type=cache,target=/root/.cache/uv \
    --mount=type=cache,target=/root/.cache/ccache \
    --mount=type=cache,target=/root/.cache/vllm-rig \
    --mount=type=secret,id=host_ca \
    . scripts/host-ca.sh \
    && ./build.sh \
    && rm -rf vllm/build vllm-cpu/build

# start.sh runs through `uv run` of noxfile.py: its environment is made here, outside any cache mount, so
# it is part of the image and a container start needs no network.
RUN --mount=type=secret,id=host_ca \
    . scripts/host-ca.sh \
    && scripts/nox.sh -l > /dev/null

# Inside the container the API listens on every interface; the address Docker publishes it on decides who
# reaches it. LOG empty keeps the engine's output on stdout (docker logs). STOP_TIMEOUT stays under the
# 20 s stop timeout, so the rig's own SIGKILL of what is left comes before Docker's. UV_OFFLINE: all that
# start.sh needs is in the image.
ENV UV_OFFLINE=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    CKPT=/models/Qwen3.8-Flash-Next \
    HOST=0.0.0.0 \
    PORT=8000 \
    LOG="" \
    CACHE_ROOT=/cache \
    STOP_TIMEOUT=15
EXPOSE 8000

# tini as PID 1 passes SIGTERM on; the image is built, so a start never builds (--no-build).
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["./start.sh", "--foreground", "--no-build"]
