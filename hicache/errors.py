"""The hicache error hierarchy.

Every error carries a stable numeric code. The wire protocol sends the same codes in its
error replies, so a client can tell "you sent a bad page id" from "the daemon is
draining" without parsing text. Codes are append-only: never renumber one.

Mechanism code raises these for caller bugs (a double free, unlocking what was never
locked, breaking a tier invariant). "Cannot right now" conditions — no free pages, a
miss — are not errors: those calls return ``None`` or an empty result.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    INTERNAL = 1
    INVALID_ARGUMENT = 2
    PAGE_OUT_OF_RANGE = 3
    DOUBLE_FREE = 4
    UNKNOWN_NAMESPACE = 5
    UNKNOWN_NODE = 6
    LOCK_UNDERFLOW = 7
    RESIDENCY = 8
    SPEC_MISMATCH = 9
    LOAD_FAILED = 10
    STALE_TICKET = 11
    TIMEOUT = 12
    STORAGE_UNAVAILABLE = 13
    UNKNOWN_SESSION = 14
    VERSION_MISMATCH = 15
    DRAINING = 16
    RESOURCE_EXHAUSTED = 17
    UNAVAILABLE = 18
    PERMISSION_DENIED = 19


class HicacheError(Exception):
    """Base class; ``code`` is stable across releases and travels on the wire."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"[{self.code.name}] {self.message}"


class InvariantBroken(HicacheError, RuntimeError):
    """An internal invariant does not hold: a bug. ``check`` names the one it found."""

    code = ErrorCode.INTERNAL


class InvalidArgument(HicacheError, ValueError):
    code = ErrorCode.INVALID_ARGUMENT


class PageOutOfRange(InvalidArgument):
    code = ErrorCode.PAGE_OUT_OF_RANGE


class DoubleFree(InvalidArgument):
    code = ErrorCode.DOUBLE_FREE


class UnknownNamespace(HicacheError, KeyError):
    code = ErrorCode.UNKNOWN_NAMESPACE


class UnknownNode(HicacheError, KeyError):
    code = ErrorCode.UNKNOWN_NODE


class LockUnderflow(HicacheError, RuntimeError):
    code = ErrorCode.LOCK_UNDERFLOW


class ResidencyError(HicacheError, RuntimeError):
    """A tier change that would break a residency invariant (closure under ancestors,
    leaf-first removal)."""

    code = ErrorCode.RESIDENCY


class SpecMismatch(InvalidArgument):
    code = ErrorCode.SPEC_MISMATCH


class LoadFailed(HicacheError, RuntimeError):
    """A load could not complete; the engine must compute those tokens itself."""

    code = ErrorCode.LOAD_FAILED


class StaleTicket(HicacheError, RuntimeError):
    """A load ticket's counter slot has been reused: the waiter asked too late."""

    code = ErrorCode.STALE_TICKET


class WaitTimeout(HicacheError, TimeoutError):
    code = ErrorCode.TIMEOUT


class DeadlinePassed(HicacheError, TimeoutError):
    """A request's deadline passed before it was done: its caller gave up on it, and
    nothing of it took effect."""

    code = ErrorCode.TIMEOUT


class StorageUnavailable(HicacheError, RuntimeError):
    """The store is closed, failed to open, or is used from a process that did not open it."""

    code = ErrorCode.STORAGE_UNAVAILABLE


class RecordsUnreadable(StorageUnavailable):
    """A get could not read the bytes of the records at indices ``unreadable`` (an I/O
    error there: nothing is known of them) and judged the others on their own:
    ``found`` is the get's answer for those (``False`` at the unreadable ones). A caller
    that reads it as a plain :class:`StorageUnavailable` loses nothing but the others."""

    def __init__(self, message: str, found: list[bool], unreadable: list[int]) -> None:
        super().__init__(message)
        self.found = found
        self.unreadable = unreadable


class UnknownSession(HicacheError, KeyError):
    """No such session: it expired, ended, or the daemon restarted (reconnect)."""

    code = ErrorCode.UNKNOWN_SESSION


class VersionMismatch(HicacheError, ValueError):
    code = ErrorCode.VERSION_MISMATCH


class Draining(HicacheError, RuntimeError):
    code = ErrorCode.DRAINING


class ResourceExhausted(HicacheError, RuntimeError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class PermissionDenied(HicacheError, PermissionError):
    """The caller's identity may not do this (a tenant it is not allowed, an
    administrative request)."""

    code = ErrorCode.PERMISSION_DENIED


class Unavailable(HicacheError, ConnectionError):
    """The daemon did not answer in time (client side)."""

    code = ErrorCode.UNAVAILABLE
