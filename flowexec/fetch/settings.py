"""Process-wide defaults, read at each wait (``flowexec.fetch.configure`` sets them):
``timeout_s`` bounds every wait (``FLOWEXEC_FETCH_TIMEOUT_S``, 300), ``spin_s`` is how long a wait
busy-polls before it sleeps (``FLOWEXEC_FETCH_SPIN_US``, 200 µs), ``backend`` the back-end asked
for (``FLOWEXEC_FETCH_BACKEND``, ``auto``)."""
from __future__ import annotations

import os

timeout_s = float(os.environ.get("FLOWEXEC_FETCH_TIMEOUT_S", "300"))
spin_s = float(os.environ.get("FLOWEXEC_FETCH_SPIN_US", "200")) * 1e-6
backend = os.environ.get("FLOWEXEC_FETCH_BACKEND", "auto")
