"""The transport of the data plane's own requests (``signed_http``; ``loop_get`` takes
its endpoint, TLS and timeouts): botocore's public ``URLLib3Session``, made as botocore makes the boto3
client's, from the same settings.

botocore keeps its client's session on a private attribute (``client._endpoint``), and
its TLS and proxy choices inside it; none of that is read here. The same choices are
made again from public inputs, as botocore's ``EndpointCreator`` and ``ClientArgsCreator``
make them: ``verify`` as given (``EC_S3_VERIFY_TLS``), proxies from the client's
``Config.proxies`` or else the environment (``HTTP_PROXY``, ``NO_PROXY``, ...), the
timeouts, pool size and TCP keep-alive of the client's ``Config``. The session has a
pool of its own, beside the boto3 client's.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from botocore.config import Config

from app.tiers.s3.botocore_adapter import (
    ProxyConfiguration,
    URLLib3Session,
    get_environ_proxies,
)


@dataclass(frozen=True)
class S3Transport:
    """How the tier's own requests reach ``endpoint``."""

    endpoint: str
    #: ``verify=`` as botocore takes it: False, True (its CA bundle) or a bundle's path.
    verify: bool | str
    session: URLLib3Session
    #: The proxy requests to ``endpoint`` go through, if any.
    proxy_url: str | None

    @property
    def host(self) -> str:
        """The ``Host`` header of a request to ``endpoint``, as botocore signs it."""
        parts = urlsplit(self.endpoint)
        host = parts.hostname or ""
        if ":" in host:  # an IPv6 literal
            host = f"[{host}]"
        if parts.port is not None and parts.port != {"http": 80, "https": 443}.get(parts.scheme):
            host = f"{host}:{parts.port}"
        return host


def s3_transport(endpoint: str, verify: bool | str, config: Config) -> S3Transport:
    """The transport of a boto3 client made with ``endpoint_url=endpoint``,
    ``verify=verify`` and ``config``."""
    proxies = config.proxies or get_environ_proxies(endpoint)
    socket_options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
    if config.tcp_keepalive:
        socket_options.append((socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1))
    session = URLLib3Session(
        verify=verify,
        proxies=proxies,
        timeout=(config.connect_timeout, config.read_timeout),
        max_pool_connections=config.max_pool_connections,
        socket_options=socket_options,
        client_cert=config.client_cert,
        proxies_config=config.proxies_config,
    )
    proxy_url = ProxyConfiguration(proxies, config.proxies_config).proxy_url_for(endpoint)
    return S3Transport(endpoint.rstrip("/"), verify, session, proxy_url)
