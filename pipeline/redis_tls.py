# TLS settings in the query of our own Redis URL schemes (rediss+sentinel://...,
# rediss+cluster://...), named as redis-py names them in a rediss:// URL, so that one
# spelling works for all three:
#   ?ssl_ca_certs=/etc/redis/ca.crt            the CA that signed the servers' certificates
#   &ssl_certfile=...&ssl_keyfile=...          a client certificate (tls-auth-clients yes)
#   &ssl_cert_reqs=required|optional|none      verify the server's certificate (required)
#   &ssl_check_hostname=true|false             and that it names the host dialled

from __future__ import annotations

from urllib.parse import parse_qsl

PATHS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
CERT_REQS = ("required", "optional", "none")
BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def tls_options(query: str, tls: bool, url: str) -> dict:
    """The keyword arguments of redis-py's connections that `query` names: with
    ssl=True where `tls` (a rediss+ scheme), none where there is no query. A
    ValueError names a setting that is unknown, malformed, or given without TLS."""
    settings = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    if settings and not tls:
        raise ValueError(f"TLS settings need a rediss+ scheme: {url!r}")
    options: dict = {"ssl": True} if tls else {}
    for name, value in settings:
        if name in PATHS and value:
            options[name] = value
        elif name == "ssl_cert_reqs" and value in CERT_REQS:
            options[name] = value
        elif name == "ssl_check_hostname" and value.lower() in BOOLEANS:
            options[name] = BOOLEANS[value.lower()]
        else:
            raise ValueError(f"unknown TLS setting {name}={value!r} in {url!r}: these are "
                             f"{', '.join(PATHS)}, ssl_cert_reqs ({'|'.join(CERT_REQS)}) "
                             "and ssl_check_hostname (true|false)")
    return options
