#!/usr/bin/env bash
# Container entry point: the start-up check (fails fast, one line per problem), then tritonserver.
# Arguments are appended to tritonserver's command line. Env: MODEL_REPOSITORY (default: the image's),
# DDTREE_SKIP_CHECK=1 to start without the check.
set -euo pipefail
cd /opt/ddtree
REPO="${MODEL_REPOSITORY:-/opt/ddtree/model_repository}"
if [[ "${DDTREE_SKIP_CHECK:-0}" != 1 ]]; then
  python3 scripts/check_deployment.py --model-repository "$REPO" --requirements requirements/gpu.txt
fi
exec tritonserver --model-repository="$REPO" --exit-timeout-secs="${EXIT_TIMEOUT_SECS:-30}" "$@"
