#!/usr/bin/env bash
# Install gns_callback with what the demo and the tests need.
# torch first: a bare `torch` requirement with no torch installed would pull a several-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch" 2>/dev/null; then
  python3 -m pip install --quiet torch==2.13.0
fi
# The test extra brings both Lightning namespaces (pytorch-lightning and the unified lightning package) and
# jsonargparse for LightningCLI: the tests run the callback under each.
python3 -m pip install --quiet -e ".[test]"
