"""Container health check: exit 0 when Triton's readiness endpoint (/v2/health/ready) answers 200 (stdlib only)."""

import os
import sys
import urllib.request

URL = f"http://127.0.0.1:{os.environ.get('TRITON_HTTP_PORT', '8000')}/v2/health/ready"

try:  # never through a proxy: the server is in this container
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(URL, timeout=4) as response:
        sys.exit(0 if response.status == 200 else 1)
except Exception as e:
    print(f"not ready: {URL}: {e}")
    sys.exit(1)
