"""What a CPU benchmark's results file starts with (the GPU ones use ``ops.run_meta``, whose
commit must come from ``FLOWEXEC_COMMIT``: the lent machine's git is stale)."""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from typing import Any

import torch


def host_meta(command: str) -> dict[str, Any]:
    """Processor, CPU count, versions, date, the command and the commit (``FLOWEXEC_COMMIT``,
    else this checkout's ``git rev-parse``)."""
    commit = os.environ.get("FLOWEXEC_COMMIT")
    if commit is None:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    return {"device": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "command": command, "commit": commit}
