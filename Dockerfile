# prime-node on a CUDA machine: the contributor daemon with the vLLM backend (`gpu` extra).
# Not built in this project's CI (no Docker engine there); kept conventional and minimal on purpose.
#   docker build -t prime-node .
#   docker run --gpus all --init -v ~/.prime-node:/data prime-node start --gpu --data-dir /data
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
COPY pyproject.toml README.md ./
COPY node ./node
COPY p2p ./p2p
COPY proofs ./proofs
COPY trainer ./trainer
# Here torch comes with CUDA (pulled by vllm), unlike the CPU-only developer set-up in scripts/setup.sh.
RUN pip install --upgrade pip && pip install ".[gpu]"

# Keys and checkpoints live in a volume; the status API stays on 127.0.0.1 inside the container
# unless the operator configures otherwise.
VOLUME ["/data"]
ENTRYPOINT ["prime-node"]
CMD ["--help"]
