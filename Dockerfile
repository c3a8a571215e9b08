# prime-node on a CUDA machine: every command, with the vLLM backend (`gpu` extra); made for contributors.
# How to build and run it, with an operator key, ports and volume: docs/deploy.md, section "Docker".
# Not built in this project's CI (no Docker engine there); tests/test_dockerfile.py checks what it can.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1
# bubblewrap: the sandbox of code environments (node/environments/sandbox.py). Inside a container it needs
# namespaces, which Docker's default seccomp and AppArmor profiles refuse: run with
# `--security-opt seccomp=unconfined --security-opt apparmor=unconfined` to score code tasks (otherwise code
# environments refuse to start, the rest works), and with `--init`, so that the sandboxes' exited init
# processes are reaped (prime-node is not a reaper when it runs as the container's pid 1).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential bubblewrap \
 && rm -rf /var/lib/apt/lists/*

# A venv keeps the image's system Python untouched (PEP 668 on Ubuntu 24.04).
RUN python3 -m venv /opt/prime-node
ENV PATH=/opt/prime-node/bin:$PATH

WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY node ./node
COPY p2p ./p2p
COPY proofs ./proofs
COPY trainer ./trainer
# Here torch comes with CUDA (pulled by vllm), unlike the CPU-only developer set-up in scripts/setup.sh.
RUN pip install --upgrade pip && pip install ".[gpu]"

# Nothing runs as root: the node parses bytes from strangers. Ubuntu 24.04 images ship a user "ubuntu" with
# uid 1000; it is removed so that ours gets that uid (a bind mount must be writable by it).
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && useradd --create-home --uid 1000 --shell /usr/sbin/nologin prime \
 && mkdir -p /data \
 && chown prime:prime /data

# Keys, checkpoints, rollouts, ledgers: the data directory is the volume.
ENV PRIME_NODE_DATA_DIR=/data
# In a container every server binds all interfaces at a fixed port, so that `docker run -p` can publish it
# (outside containers they stay on 127.0.0.1). Ports: 31337 libp2p, 8470 weights, 8471 validator API and
# dashboard, 8472 contributor status API and /metrics, 8473 trainer /metrics (docs/deploy.md).
ENV PRIME_NODE_SWARM__HOST_MADDRS='["/ip4/0.0.0.0/tcp/31337"]' \
    PRIME_NODE_SERVE__HOST=0.0.0.0 \
    PRIME_NODE_SERVE__PORT=8470 \
    PRIME_NODE_DASHBOARD__HOST=0.0.0.0 \
    PRIME_NODE_DASHBOARD__PORT=8471 \
    PRIME_NODE_STATUS_HOST=0.0.0.0 \
    PRIME_NODE_STATUS_PORT=8472 \
    PRIME_NODE_SERVICE__METRICS_HOST=0.0.0.0 \
    PRIME_NODE_SERVICE__METRICS_PORT=8473
EXPOSE 31337/tcp 8470/tcp 8471/tcp 8472/tcp 8473/tcp

USER prime
WORKDIR /home/prime
VOLUME ["/data"]

# The contributor's own status API answers (its model load and first checkpoint can take minutes).
HEALTHCHECK --interval=30s --timeout=15s --start-period=10m --retries=3 CMD ["prime-node", "status"]

ENTRYPOINT ["prime-node"]
CMD ["--help"]
