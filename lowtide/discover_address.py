"""`[pool] discover = "dns:NAME:PORT"`: the form of the address a vLLM pool is found at."""

from __future__ import annotations

import ipaddress
import re

_DNS_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?\.?$")


def parse_discover(value: str) -> tuple[str, int]:
    """`[pool] discover = "dns:NAME:PORT"` → (NAME, PORT): every address NAME resolves to is one
    server at `http://ADDRESS:PORT/v1` (`vllm_pool.discovery`). NAME is a DNS name or an IP
    literal, IPv6 in brackets (`dns:[fd00::1]:8000`). Raises ValueError saying what is wrong."""
    example = "write it like dns:vllm-headless.default.svc.cluster.local:8000"
    name, sep, port = value.removeprefix("dns:").rpartition(":")
    if not value.startswith("dns:") or not sep:
        raise ValueError(f"{value!r} is not of the form dns:NAME:PORT; {example}")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
        try:
            valid_name = ipaddress.ip_address(name).version == 6
        except ValueError:
            valid_name = False
    else:
        valid_name = _DNS_NAME.match(name) is not None
    if not valid_name:
        raise ValueError(f"{value!r} has no valid NAME in dns:NAME:PORT; {example}")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError(f"{value!r} needs a PORT from 1 to 65535 in dns:NAME:PORT; {example}")
    return name, int(port)
