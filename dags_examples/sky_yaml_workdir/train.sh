#!/bin/sh
# A stand-in training script that lives in the task's workdir (synced to every node).
echo "training step on rank ${SKYPILOT_NODE_RANK} in $(pwd)"
