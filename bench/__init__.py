"""Side-by-side benchmarks of ec-cache against its ceilings and the alternatives.

``python -m bench`` runs everything (see ``bench/README.md``); ``python -m bench --quick``
is the CI smoke run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# The SDK is its own distribution (client/); use the checkout's copy when it is not
# installed in this environment.
if importlib.util.find_spec("ec_cache") is None:  # pragma: no cover - environment dependent
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "client"))
