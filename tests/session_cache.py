"""One zeroserve cache folder for a test session, shared by every process kind.

`ZEROSERVE_CACHE_DIR` holds the prepared weights (worker/weight_cache.py) and the compiled
kernels' inductor code. The in-process engines of tests/worker and the servers tests start
(tests/e2e's `real_model_server`) use the same folder, so the default model's weights are
prepared once a session for each dtype (~20-40 s each on two cores) instead of once per
process kind; and never in the user's ~/.cache/zeroserve.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def session_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.getbasetemp() / "zeroserve-cache"
    path.mkdir(exist_ok=True)
    return path
