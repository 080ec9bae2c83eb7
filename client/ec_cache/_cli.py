"""``ec-cache``: the operator's command line for an ec-cache deployment.

torch is imported only by the commands that move a tensor (``get``, ``put``): the
others start in a fraction of the time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from . import __version__, _cli_ops
from ._config import Retries, Timeouts
from ._exceptions import (
    ECCacheError,
    IntegrityError,
    InvalidKeyError,
    InvalidTensorError,
    UnavailableError,
)
from ._keys import DTYPE_NAMES
from ._routing import normalize_url
from ._sync.client import Client
from ._tensors import (
    EntryInfo,
    build_header,
    parse_header,
    parse_header_length,
    tensor_memoryview,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch

EXIT_OK, EXIT_MISS, EXIT_USAGE, EXIT_ERROR, EXIT_INTEGRITY = 0, 1, 2, 3, 4

EPILOG = """\
exit status:
  0  success
  1  miss: the entry (or, for `exists`, at least one entry) is not in the cache
  2  usage: bad arguments, invalid model/dtype/hash, unreadable or unsupported file
  3  server or transport error (HTTP 4xx/5xx, refused connection, timeout); a 503
     (the server cannot tell, e.g. its S3 tier is unreachable) is this, not a miss
  4  integrity error: the received body does not match its checksum, dtype or shape

environment:
  EC_CACHE_URL    default --url (comma-separated for several replicas)
  EC_CACHE_MODEL  default --model
  EC_CACHE_DTYPE  default --dtype
  EC_CACHE_TOKEN  default --token

examples:
  ec-cache --url http://cache:8080 --model Qwen/Qwen2.5-VL-7B-Instruct --dtype bfloat16 head 3f2a
  ec-cache get 3f2a -o vision.safetensors
  ec-cache put vision.npy 3f2a
  ec-cache exists 3f2a 77b1 --json
  ec-cache stats
  ec-cache ls                                  # namespaces on each replica's disk
  ec-cache ls --model Qwen/Qwen2.5-VL-7B-Instruct --dtype bfloat16 --s3
  ec-cache du --json
  ec-cache purge --model Qwen/Qwen2.5-VL-7B-Instruct@a1b2c3   # asks first; --yes to skip
"""


class _Fail(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _globals(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    def d(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    env = os.environ.get
    g = parser.add_argument_group("connection options (before or after the command)")
    g.add_argument(
        "--url",
        action="append",
        default=d(None),
        metavar="URL",
        help="server base URL; repeat for several replicas (rendezvous hashing "
        "picks one per key). Default: $EC_CACHE_URL or http://127.0.0.1:8080",
    )
    g.add_argument(
        "--model",
        default=d(env("EC_CACHE_MODEL")),
        help="model namespace, slashes allowed (default: $EC_CACHE_MODEL)",
    )
    g.add_argument(
        "--dtype",
        default=d(env("EC_CACHE_DTYPE")),
        choices=DTYPE_NAMES,
        metavar="DTYPE",
        help="tensor dtype: "
        + ", ".join(DTYPE_NAMES)
        + " (default: $EC_CACHE_DTYPE; `put` takes the file's dtype, and refuses another"
        " one unless --convert)",
    )
    g.add_argument(
        "--token", default=d(env("EC_CACHE_TOKEN")), help="bearer token (default: $EC_CACHE_TOKEN)"
    )
    g.add_argument(
        "--json",
        action="store_true",
        default=d(False),
        help="print machine-readable JSON instead of text",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=d(30.0),
        help="seconds allowed per connect/read/write (default: 30)",
    )
    g.add_argument(
        "--retries",
        type=int,
        default=d(3),
        help="attempts per request on transport errors (default: 3)",
    )
    g.add_argument(
        "--progress",
        choices=["auto", "always", "never"],
        default=d("auto"),
        help="progress on stderr for transfers of 8 MiB or more: auto (when "
        "stderr is a terminal), always, never (default: auto)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ec-cache",
        description="Inspect and move entries of an ec-cache server (multimodal encoder "
        "outputs keyed by model, dtype and hash).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ec-cache {__version__}")
    _globals(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    _globals(common, suppress=True)

    def add(name: str, help: str, aliases: Sequence[str] = ()) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            description=help,
            parents=[common],
            aliases=list(aliases),
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    p = add(
        "head",
        "show an entry's dtype, shape, size, checksum and tier (no download); exit 1 when absent",
        aliases=["info"],
    )
    p.add_argument("hash")
    p = add(
        "get",
        "download an entry into FILE (.safetensors with one tensor named 'tensor', .pt via "
        "torch.save, .npy via numpy; - writes the safetensors body to stdout); "
        "exit 1 when absent",
    )
    p.add_argument("hash")
    p.add_argument("-o", "--output", required=True, metavar="FILE")
    p = add(
        "put",
        "upload the single tensor of FILE (.safetensors, .pt/.pth, .npy) under "
        "HASH, in the file's dtype; prints whether it was created or already present",
    )
    p.add_argument("file", metavar="FILE")
    p.add_argument("hash")
    p.add_argument(
        "--convert",
        action="store_true",
        help="when --dtype differs from the file's dtype, convert the tensor to it "
        "(without this flag such a put is refused)",
    )
    p = add(
        "rm",
        "delete entries from every replica (and from S3 where the servers have an S3 "
        "tier); absent entries are fine",
    )
    p.add_argument("hashes", nargs="+", metavar="HASH")
    p = add("exists", "check several hashes in one request per replica; exit 1 when any is absent")
    p.add_argument("hashes", nargs="+", metavar="HASH")
    add("stats", "print each replica's GET /stats summary")
    _cli_ops.add_commands(add)
    return parser


# -- files ----------------------------------------------------------------------------
def load_file(path: Path) -> torch.Tensor:
    import torch

    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            data = path.read_bytes()
            n = parse_header_length(data[:8], len(data))
            meta = parse_header(data[8 : 8 + n], total=len(data))
            raw = torch.frombuffer(bytearray(data[meta.data_offset :]), dtype=torch.uint8)
            dtype = torch_dtype(meta.dtype)
            if meta.nbytes == 0:
                return torch.empty(meta.shape, dtype=dtype)
            return raw.view(dtype).view(meta.shape)
        if suffix in (".pt", ".pth"):
            obj = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(obj, dict):
                tensors = [v for v in obj.values() if isinstance(v, torch.Tensor)]
                if len(tensors) != 1:
                    raise _Fail(EXIT_USAGE, f"{path}: holds {len(tensors)} tensors, need one")
                obj = tensors[0]
            if not isinstance(obj, torch.Tensor):
                raise _Fail(EXIT_USAGE, f"{path}: holds a {type(obj).__name__}, not a tensor")
            return obj
        if suffix == ".npy":
            np = _numpy()
            return torch.from_numpy(np.load(path, allow_pickle=False))
    except IntegrityError as exc:
        raise _Fail(EXIT_USAGE, f"{path}: not a single-tensor safetensors file: {exc}") from None
    except OSError as exc:
        raise _Fail(EXIT_USAGE, f"{path}: {exc.strerror or exc}") from None
    except (ValueError, RuntimeError) as exc:
        raise _Fail(EXIT_USAGE, f"{path}: cannot load: {exc}") from None
    raise _Fail(EXIT_USAGE, f"{path}: unsupported file type (.safetensors, .pt, .pth, .npy)")


def save_file(tensor: torch.Tensor, output: str) -> None:
    if output == "-":
        sys.stdout.buffer.write(build_header(_dtype_name(tensor), tuple(tensor.shape)))
        sys.stdout.buffer.write(tensor_memoryview(tensor.contiguous()))
        sys.stdout.buffer.flush()
        return
    import torch

    path = Path(output)
    suffix = path.suffix.lower()
    try:
        if suffix in (".pt", ".pth"):
            torch.save(tensor, path)
        elif suffix == ".npy":
            np = _numpy()
            if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
                raise _Fail(EXIT_USAGE, f"numpy has no {tensor.dtype}; write .safetensors")
            np.save(path, tensor.numpy(), allow_pickle=False)
        else:
            with path.open("wb") as f:
                f.write(build_header(_dtype_name(tensor), tuple(tensor.shape)))
                f.write(tensor_memoryview(tensor.contiguous()))
    except OSError as exc:
        raise _Fail(EXIT_USAGE, f"{path}: {exc.strerror or exc}") from None


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        raise _Fail(EXIT_USAGE, ".npy files need numpy: pip install 'ec-cache[numpy]'") from None
    return numpy


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


# -- output ---------------------------------------------------------------------------
def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{n} B"
        value /= 1024
    return f"{n} B"  # pragma: no cover


class _Progress:
    """``done/total`` with rate on stderr, redrawn at most 10 times a second."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.start = time.monotonic()
        self.last = 0.0
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < 8 << 20:
            return
        now = time.monotonic()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-6)
        pct = 100.0 * done / total if total else 0.0
        sys.stderr.write(
            f"\r{self.label}: {_size(done)} / {_size(total)} {pct:5.1f}% {_size(int(rate))}/s "
        )
        sys.stderr.flush()
        self.drawn = True

    def end(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _info_dict(info: EntryInfo) -> dict[str, Any]:
    return {
        "hash": info.hash,
        "present": True,
        "dtype": info.dtype,
        "shape": list(info.shape),
        "size": info.size,
        "crc32c": info.crc32c,
        "tier": info.tier,
        "url": info.url,
    }


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data) if args.json else text)


# -- commands -------------------------------------------------------------------------
def _client(args: argparse.Namespace, dtype: str | None = None) -> Client:
    urls = args.url or [
        u for u in os.environ.get("EC_CACHE_URL", "http://127.0.0.1:8080").split(",") if u
    ]
    model = args.model
    dtype = dtype or args.dtype
    if args.command == "stats":
        model, dtype = model or "_", dtype or "uint8"
    if not model:
        raise _Fail(EXIT_USAGE, "--model (or $EC_CACHE_MODEL) is required")
    if not dtype:
        raise _Fail(EXIT_USAGE, "--dtype (or $EC_CACHE_DTYPE) is required")
    try:
        normalized = [normalize_url(url) for url in urls]
    except ValueError as exc:
        raise _Fail(EXIT_USAGE, str(exc)) from None
    return Client(
        normalized,
        model=model,
        dtype=dtype,
        token=args.token,
        timeouts=Timeouts.of(args.timeout),
        retries=Retries(attempts=max(1, args.retries)),
        # An operator asking about an entry must tell "absent" from "cannot tell".
        raise_on_unavailable=True,
    )


def _progress_enabled(args: argparse.Namespace) -> bool:
    return args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())


def cmd_head(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = client.head(args.hash)
    if info is None:
        _emit(args, {"hash": args.hash, "present": False}, f"{args.hash}: not found")
        return EXIT_MISS
    shape = " x ".join(str(d) for d in info.shape) or "scalar"
    text = "\n".join(
        [
            f"hash     {info.hash}",
            f"dtype    {info.dtype}",
            f"shape    {shape}",
            f"size     {_size(info.size)} ({info.size} bytes)",
            f"crc32c   {info.crc32c}",
            f"tier     {info.tier}",
            f"replica  {info.url}",
        ]
    )
    _emit(args, _info_dict(info), text)
    return EXIT_OK


def cmd_get(args: argparse.Namespace) -> int:
    progress = _Progress(f"get {args.hash}", _progress_enabled(args))
    with _client(args) as client:
        tensor = client.get(args.hash, progress=progress)
    progress.end()
    if tensor is None:
        if args.output != "-":
            _emit(args, {"hash": args.hash, "present": False}, f"{args.hash}: not found")
        else:
            print(f"{args.hash}: not found", file=sys.stderr)
        return EXIT_MISS
    save_file(tensor, args.output)
    if args.output != "-":
        nbytes = tensor.numel() * tensor.element_size()
        _emit(
            args,
            {
                "hash": args.hash,
                "present": True,
                "file": args.output,
                "dtype": _dtype_name(tensor),
                "shape": list(tensor.shape),
            },
            f"{args.hash}: {_dtype_name(tensor)} {list(tensor.shape)} "
            f"({_size(nbytes)}) -> {args.output}",
        )
    return EXIT_OK


def cmd_put(args: argparse.Namespace) -> int:
    tensor = load_file(Path(args.file))
    file_dtype = _dtype_name(tensor)
    if file_dtype not in DTYPE_NAMES:
        raise _Fail(EXIT_USAGE, f"{args.file}: dtype {file_dtype} is not stored by ec-cache")
    if args.dtype and args.dtype != file_dtype:
        if not args.convert:
            raise _Fail(
                EXIT_USAGE,
                f"{args.file} holds {file_dtype}, but --dtype (or $EC_CACHE_DTYPE) is "
                f"{args.dtype}: add --convert to store it as {args.dtype}, or pass "
                f"--dtype {file_dtype} to store it as it is",
            )
        tensor = tensor.to(torch_dtype(args.dtype))
    progress = _Progress(f"put {args.hash}", _progress_enabled(args))
    with _client(args, dtype=args.dtype or file_dtype) as client:
        created = client.put(args.hash, tensor, progress=progress)
    progress.end()
    state = "created" if created else "already present (unchanged)"
    _emit(
        args,
        {
            "hash": args.hash,
            "created": created,
            "dtype": _dtype_name(tensor),
            "shape": list(tensor.shape),
        },
        f"{args.hash}: {state}, {_dtype_name(tensor)} {list(tensor.shape)}",
    )
    return EXIT_OK


def cmd_rm(args: argparse.Namespace) -> int:
    with _client(args) as client:
        for value in args.hashes:
            client.delete(value)
    _emit(args, {"deleted": args.hashes}, "\n".join(f"{h}: deleted" for h in args.hashes))
    return EXIT_OK


def cmd_exists(args: argparse.Namespace) -> int:
    with _client(args) as client:
        present = client.exists_many(args.hashes)
    _emit(
        args,
        dict(zip(args.hashes, present, strict=True)),
        "\n".join(
            f"{h}: {'present' if p else 'absent'}"
            for h, p in zip(args.hashes, present, strict=True)
        ),
    )
    return EXIT_OK if all(present) else EXIT_MISS


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as client:
        stats = client.stats()
    failed = any(set(v) == {"error"} for v in stats.values())
    if args.json:
        print(json.dumps(stats))
    else:
        for url, data in stats.items():
            print(url)
            for line in _flatten(data):
                print(f"  {line}")
    return EXIT_ERROR if failed else EXIT_OK


def _unavailable(exc: UnavailableError) -> str:
    later = f"; retry in {exc.retry_after:g} s" if exc.retry_after is not None else ""
    return f"server unavailable (HTTP 503 from {exc.url}): {exc.message}{later}"


def _flatten(data: Any, prefix: str = "") -> list[str]:
    if isinstance(data, dict):
        out: list[str] = []
        for key, value in data.items():
            out += _flatten(value, f"{prefix}{key}.")
        return out
    return [f"{prefix[:-1]:32s} {data}"]


COMMANDS = {
    "head": cmd_head,
    "info": cmd_head,
    "get": cmd_get,
    "put": cmd_put,
    "rm": cmd_rm,
    "exists": cmd_exists,
    "stats": cmd_stats,
    **_cli_ops.COMMANDS,
}


def main(argv: Sequence[str] | None = None) -> NoReturn:
    args = build_parser().parse_args(argv)  # exits 2 on usage errors
    try:
        code = COMMANDS[args.command](args)
    except _Fail as exc:
        print(f"ec-cache: {exc}", file=sys.stderr)
        code = exc.code
    except (InvalidKeyError, InvalidTensorError) as exc:
        print(f"ec-cache: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except IntegrityError as exc:
        print(f"ec-cache: integrity error: {exc}", file=sys.stderr)
        code = EXIT_INTEGRITY
    except UnavailableError as exc:
        print(f"ec-cache: {_unavailable(exc)}", file=sys.stderr)
        code = EXIT_ERROR
    except ECCacheError as exc:
        print(f"ec-cache: {exc}", file=sys.stderr)
        code = EXIT_ERROR
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
