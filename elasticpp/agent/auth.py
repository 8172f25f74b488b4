"""Who may call what on an agent: one policy (`decide`, pure), enforced by one interceptor
for every service the agent serves (the control service, the state service, health).

Doors, after Patroni's split of safe and unsafe endpoints:
- health: anyone who reaches the port (over TLS: with a certificate of the job's CA);
- read (GetStatus): the same;
- control (Drain, LiftQuarantine, WatchEvents, and any later call that changes state or
  holds a slot): the bearer token (`--token-file`), or the local control socket, whose file
  permissions are its guard (under TLS without a token file: the socket alone);
- peer (the state service: every weight and optimizer moment): over TLS, a certificate whose
  common name is a member node of the job (or the job's shared name, `--tls-shared-identity`:
  weaker, every holder passes as any node).
A method this table does not name is refused: a new RPC is closed until it is classified.
Without TLS and without a token (a loopback agent, or `--insecure`) every door is open, as
on a developer's machine.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from elasticpp.transport import AUTHORIZATION, BEARER, TokenFile, peer_identity

log = logging.getLogger("elasticpp.agent.audit")


class Door(enum.Enum):
    HEALTH = "health"
    READ = "read"
    CONTROL = "control"
    PEER = "peer"


_AGENT = "/elasticpp.agent.v1.AgentService/"
_STATE = "/elasticpp.state.v1.StateService/"
METHODS: dict[str, Door] = {
    "/grpc.health.v1.Health/Check": Door.HEALTH,
    "/grpc.health.v1.Health/Watch": Door.HEALTH,
    _AGENT + "GetStatus": Door.READ,
    _AGENT + "Drain": Door.CONTROL,
    _AGENT + "LiftQuarantine": Door.CONTROL,
    _AGENT + "WatchEvents": Door.CONTROL,  # holds one of a few stream slots
    _STATE + "ListSteps": Door.PEER,
    _STATE + "ListHoldings": Door.PEER,
    _STATE + "FetchPiece": Door.PEER,
}


@dataclass(frozen=True)
class Caller:
    """What the server knows of a call's caller."""

    local: bool  # over the control socket
    identity: str | None  # the common name of its TLS client certificate
    token_ok: bool  # it presented the agent's token


@dataclass(frozen=True)
class Policy:
    tls: bool  # the network port takes mutual TLS only
    token: bool  # control calls need the token (or the control socket)
    shared_identity: str | None = None  # a certificate name trusted as any node


def decide(
    method: str, caller: Caller, policy: Policy, is_member: Callable[[str], bool]
) -> tuple[grpc.StatusCode, str] | None:
    """None if `caller` may call `method`, else the status code and why."""
    door = METHODS.get(method)
    if door is None:
        return grpc.StatusCode.PERMISSION_DENIED, f"{method[:120]}: not a call this agent serves"
    if caller.local:
        return None
    # Under TLS a certificate alone never drains a node: without a token file, state-changing
    # calls come through the control socket only.
    if door is Door.CONTROL and (policy.token or policy.tls) and not caller.token_ok:
        return (
            grpc.StatusCode.UNAUTHENTICATED,
            "a state-changing call needs the agent's token (ctl --token-file) or its control "
            "socket",
        )
    if door is Door.PEER and policy.tls:
        who = caller.identity
        if who is None:
            return grpc.StatusCode.UNAUTHENTICATED, "state transfers need a node certificate"
        if who != policy.shared_identity and not is_member(who):
            return (
                grpc.StatusCode.PERMISSION_DENIED,
                f"certificate {who[:64]!r} is not a node of this job",
            )
    return None


def _token(context: grpc.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == AUTHORIZATION and isinstance(value, str) and value.startswith(BEARER):
            return value[len(BEARER) :]
    return None


class AuthInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Enforces `decide` before every handler runs; a refused call never reaches the agent.
    Every state-changing call that is let through is logged with its caller (an audit
    line; never the token)."""

    def __init__(
        self, policy: Policy, token: TokenFile | None, is_member: Callable[[str], bool]
    ) -> None:
        self.policy = policy
        self._token = token
        self._is_member = is_member

    def _caller(self, context: grpc.ServicerContext) -> Caller:
        local = str(context.peer()).startswith("unix:")
        token_ok = self._token is not None and self._token.matches(_token(context))
        identity = peer_identity(context) if self.policy.tls and not local else None
        return Caller(local=local, identity=identity, token_ok=token_ok)

    def _check(self, method: str, context: grpc.ServicerContext) -> None:
        caller = self._caller(context)
        refused = decide(method, caller, self.policy, self._is_member)
        if refused is not None:
            context.abort(*refused)
        if METHODS.get(method) is Door.CONTROL:
            who = "control socket" if caller.local else (caller.identity or context.peer())
            log.info("audit: %s by %s", method.rsplit("/", 1)[-1], who)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = str(details.method)
        check = self._check
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            def unary_unary(request: Any, context: grpc.ServicerContext) -> Any:
                check(method, context)
                return inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream
            behavior: Any
            if getattr(inner_us, "experimental_non_blocking", False):
                # grpc.health's Watch sends from its own callback and holds no thread.
                def behavior(request: Any, context: grpc.ServicerContext, send: Any) -> Any:
                    check(method, context)
                    return inner_us(request, context, send)

                behavior.experimental_non_blocking = True
                behavior.experimental_thread_pool = getattr(
                    inner_us, "experimental_thread_pool", None
                )
            else:

                def behavior(request: Any, context: grpc.ServicerContext) -> Any:
                    check(method, context)
                    yield from inner_us(request, context)

            return grpc.unary_stream_rpc_method_handler(
                behavior,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        # Streaming requests: none of the agent's services has one; refused, not served open.
        def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{method[:120]}: not served")

        return grpc.unary_unary_rpc_method_handler(refuse)
