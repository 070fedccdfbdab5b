#!/bin/bash
# Multi-host training without a scheduler: start this on every host at about the same time, with
# the same config and overrides; only JAX_PROCESS_ID differs. One process per host drives all its
# GPUs. Run it from the repository root (relative paths in configs start there). For 2 hosts:
#
#   host0$ JAX_COORDINATOR_ADDRESS=host0:12355 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 \
#              scripts/multihost.sh configs/gpu/llama-3.2-1b_basp.yaml model.hf_path=... data.path=...
#   host1$ JAX_COORDINATOR_ADDRESS=host0:12355 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 \
#              scripts/multihost.sh configs/gpu/llama-3.2-1b_basp.yaml model.hf_path=... data.path=...
#
# Environment:
#   JAX_COORDINATOR_ADDRESS  host:port of the coordinator, which process 0 starts; every process
#                            connects to it, so use the same value everywhere, a name or address
#                            the other hosts can reach, and a free port open between the hosts.
#   JAX_NUM_PROCESSES        how many processes (= hosts) take part; the run waits for all of them.
#   JAX_PROCESS_ID           this host's rank, 0 .. JAX_NUM_PROCESSES-1; 0 must run on the
#                            coordinator's host and is the one that writes run.dir (metrics,
#                            config, checkpoint metadata). Ranks also order the devices of the
#                            mesh: host r holds devices r*G .. r*G+G-1 (G GPUs per host), so each
#                            seq group of at most G devices stays inside one host.
#   JAX_LOCAL_DEVICE_IDS     optional: which local GPUs this process uses, e.g. 0,1,2,3 (read by
#                            jax.distributed.initialize; default all visible ones, which
#                            CUDA_VISIBLE_DEVICES can restrict). Every host must use as many.
#   PYTHON                   optional: the interpreter, e.g. .venv/bin/python (default: python).
#   NCCL_*                   InfiniBand between the hosts: NCCL_DEBUG=INFO on the first run (its
#                            log must say NET/IB, not NET/Socket), NCCL_IB_HCA, NCCL_SOCKET_IFNAME,
#                            NCCL_IB_GID_INDEX (RoCE): scripts/README.md says when; the same on
#                            every host.
# The three JAX_* variables are passed to train.py as runtime.distributed.* overrides, so the config
# checks them (rank in range, all three set) before anything starts.
set -euo pipefail

: "${JAX_COORDINATOR_ADDRESS:?set JAX_COORDINATOR_ADDRESS=HOST0:PORT, the same on every host}"
: "${JAX_NUM_PROCESSES:?set JAX_NUM_PROCESSES to the number of hosts}"
: "${JAX_PROCESS_ID:?set JAX_PROCESS_ID to the rank of this host, 0 .. JAX_NUM_PROCESSES-1}"
CONFIG=${1:?usage: scripts/multihost.sh CONFIG.yaml [key.sub=value ...]}
shift

exec "${PYTHON:-python}" train.py --config "$CONFIG" \
    runtime.distributed.coordinator="$JAX_COORDINATOR_ADDRESS" \
    runtime.distributed.num_processes="$JAX_NUM_PROCESSES" \
    runtime.distributed.process_id="$JAX_PROCESS_ID" \
    "$@"
