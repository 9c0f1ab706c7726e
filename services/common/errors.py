"""Errors that carry a gRPC status code. Plain logic raises these; the transport layer
(rlmesh.common.grpc_server) turns them into a status with a message a person can act
on, never a stack trace."""

from __future__ import annotations

import grpc
from pydantic import ValidationError


class RlmeshError(Exception):
    code = grpc.StatusCode.INTERNAL
    http_status = 500


class InvalidArgument(RlmeshError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400


class NotFound(RlmeshError):
    code = grpc.StatusCode.NOT_FOUND
    http_status = 404


class FailedPrecondition(RlmeshError):
    code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409


class AlreadyExists(RlmeshError):
    code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409


class ResourceExhausted(RlmeshError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429


class Unavailable(RlmeshError):
    code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class Aborted(RlmeshError):
    """The call lost a race with a state change elsewhere: the caller fixes that state and asks again."""

    code = grpc.StatusCode.ABORTED
    http_status = 409


class DeadlineExceeded(RlmeshError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504


class Unimplemented(RlmeshError):
    code = grpc.StatusCode.UNIMPLEMENTED
    http_status = 501


ERROR_BY_GRPC_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        AlreadyExists,
        ResourceExhausted,
        Unavailable,
        Aborted,
        DeadlineExceeded,
        Unimplemented,
    )
}
# For HTTP front ends (the coordinator) relaying a failed gRPC call to another service.
HTTP_STATUS_BY_GRPC_CODE = {code: cls.http_status for code, cls in ERROR_BY_GRPC_CODE.items()}


def upstream_error(service: str, address: str, e: grpc.aio.AioRpcError) -> RlmeshError:
    """A failed call to another service, as an error of ours with the same code (its
    NOT_FOUND becomes FAILED_PRECONDITION: the thing missing is there, not here)."""
    code = e.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"{service} at {address} is unavailable: {e.details()}")
    cls = FailedPrecondition if code == grpc.StatusCode.NOT_FOUND else ERROR_BY_GRPC_CODE.get(code, RlmeshError)
    return cls(f"{service} at {address} answered {code.name}: {e.details()}")


def validation_problems(e: ValidationError, whole: str = "value", most: int = 0) -> str:
    """What a pydantic validation found wrong, one `field.path: message` per problem (`whole`
    names the object itself when the problem is not a field's; `most` > 0 caps the count)."""
    found = e.errors()[:most] if most else e.errors()
    return "; ".join(f"{'.'.join(map(str, err['loc'])) or whole}: {err['msg']}" for err in found)


def unexpected(e: BaseException) -> str:
    """An unexpected error as a caller sees it: an OSError without its file names (this
    machine's directories are the operator's business; the log has them)."""
    if isinstance(e, OSError) and e.strerror:
        return f"{type(e).__name__}: {e.strerror}" + (f" (errno {e.errno})" if e.errno else "")
    return f"{type(e).__name__}: {e}"
