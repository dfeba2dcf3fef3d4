"""The session token of a vLLM server started without an API key on a loopback address.

Any local user can reach a loopback port; the server's dev routes (/collective_rpc, the weight
routes, LoRA loading) would let them replace the model or read and write files. So
`grpo_jax.serve` makes a random token per server, gives it to the server (its environment) and
writes it to `<cache>/serve/port-<port>.token`, readable by its own account only (0600 in a
0700 directory). A trainer on the same host and account reads it when it is given no API key,
so `python -m grpo_jax.serve ...` then `python -m grpo_jax.train ... --use_vllm true` just work;
anyone else can pass it as the API key. The server's inference routes stay open, as vLLM's are.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def token_path(port: int) -> Path:
    from grpo_jax.hf import cache_dir
    return cache_dir() / "serve" / f"port-{int(port)}.token"


def create(port: int) -> str:
    """A new token for the server on `port`, written (0600) where `read` finds it."""
    token = secrets.token_urlsafe(32)
    path = token_path(port)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.parent.chmod(0o700)  # also when it existed: only this account lists the tokens
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, path)  # whole or not at all: a trainer never reads half a token
    return token


def read(base_url: str) -> str | None:
    """The token of the loopback server at `base_url`, or None (another host, or no file)."""
    url = urlsplit(base_url)
    if not url.hostname or not is_loopback(url.hostname):
        return None
    try:
        return token_path(url.port or 80).read_text().strip() or None
    except OSError:
        return None


def remove(port: int, token: str) -> None:
    """Delete the token file of `port` if it still holds `token` (not a newer server's)."""
    path = token_path(port)
    try:
        if path.read_text().strip() == token:
            path.unlink()
    except OSError:
        pass
