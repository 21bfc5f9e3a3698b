"""Transfer engines behind one interface (``base``): Mooncake Transfer Engine and NIXL."""
from nexrt_vllm.transport.base import (ReceiverTransport, SenderTransport, TransferError, TransferInFlight, Write,
                                       coalesce, make_receiver, make_sender)

__all__ = ["ReceiverTransport", "SenderTransport", "TransferError", "TransferInFlight", "Write", "coalesce",
           "make_receiver", "make_sender"]
