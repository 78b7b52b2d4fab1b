"""Errors of the transfer engine."""

from __future__ import annotations


class TransferError(RuntimeError):
    """Base class for transfer failures."""


class TransferCancelled(TransferError):
    """The bulk transfer was cancelled (by this side or by the sender)."""


class PeerFailedError(TransferError):
    """The peer died, closed the link or stayed silent past the timeout.

    ``outgoing`` and ``incoming`` list, per transfer, what was and was not transferred (dicts with
    ``name``, ``chunks_done``, ``chunks_total``, ``bytes_done``, ``bytes_total``, ``state``);
    ``activations_sent`` / ``activations_unsent`` count the activation messages.
    """

    def __init__(self, message: str, *, outgoing=(), incoming=(), activations_sent=0, activations_unsent=0):
        super().__init__(message)
        self.outgoing = list(outgoing)
        self.incoming = list(incoming)
        self.activations_sent = activations_sent
        self.activations_unsent = activations_unsent
