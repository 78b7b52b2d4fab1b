"""Point-to-point transfers between instances: activations (small, urgent, in order) overtake bulk
transfers (KV blocks, weights), which are sent in chunks. gloo for CPU tensors, NCCL for CUDA.

    store = make_store(0)                       # rank 0; hand store.port to the peer
    ch = connect(0, store=store)                # peer: connect(1, port=port)
    h = ch.send_bulk(kv_blocks, "kv:req-7", chunk_bytes=policy_chunk_bytes)
    ch.send_activation(hidden_states, tag=microbatch_id)   # goes out before the next chunk
    h.wait(timeout=30)                          # PeerFailedError names what was not sent
"""

from .channel import Activation, BulkHandle, Channel, ChannelStats, connect
from .errors import PeerFailedError, TransferCancelled, TransferError
from .group import PeerGroup, make_store

__all__ = ["Activation", "BulkHandle", "Channel", "ChannelStats", "PeerFailedError", "PeerGroup",
           "TransferCancelled", "TransferError", "connect", "make_store"]
