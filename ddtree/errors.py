"""Errors the serving edge maps to Triton error codes."""


class InvalidRequest(ValueError):
    """Bad client input: the message names the field, the value and the allowed range."""


class EngineUnavailable(RuntimeError):
    """The engine cannot serve (fatal error, shutting down)."""


class RequestCancelled(Exception):
    """The client cancelled the request; raised between rounds."""
