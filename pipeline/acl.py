"""The least a role's Redis user needs: its keys and its commands, per prefix.
`pipeline acl` prints these as ACL SETUSER lines for an operator to apply."""

from __future__ import annotations

_COMMON = ["ping", "hello", "client|setname", "info", "select", "time",
           "set", "del", "exists", "get", "mget", "xinfo", "xrange", "xrevrange", "xlen",
           "zadd", "zrem", "zrangebyscore", "zremrangebyscore"]  # the workers index
_GROUP_READER = ["xreadgroup", "xack", "xgroup", "xclaim", "xpending", "xtrim",
                 "multi", "exec", "discard"]  # writes and their acks go as one MULTI/EXEC

ROLES: dict[str, tuple[list[str], list[str]]] = {
    # role: (key patterns under the prefix, commands)
    "api": (["requests", "requests:*", "control", "replies:*", "alive:*", "workers",
             "response:*"],  # stored Responses API responses
            _COMMON + ["xadd", "xread", "pexpire"]),
    "scheduler": (["requests", "requests:*", "control", "tokens", "alive:*", "workers",
                   "admitted:*", "dead"],
                  # eval: the lanes read in order (streams.pull_in_order), XREADGROUP inside
                  _COMMON + _GROUP_READER + ["xadd", "xread", "eval"]),
    "detokenizer": (["tokens", "replies:*", "alive:*", "workers", "dead",
                     "control"],  # Cancel: another model's scheduler runs a request
                    _COMMON + _GROUP_READER + ["xadd"]),
}


def acl_rules(role: str, prefix: str, password: str) -> list[str]:
    """Arguments of `ACL SETUSER {role}-user ...` for one role."""
    patterns, commands = ROLES[role]
    return (["on", f">{password}", "resetkeys", "-@all"]
            + [f"~{prefix}:{pattern}" for pattern in patterns]
            + [f"+{command}" for command in commands])


def acl_lines(prefix: str, password: str) -> list[str]:
    return [f"ACL SETUSER pipeline-{role} " + " ".join(acl_rules(role, prefix, password))
            for role in ROLES]
