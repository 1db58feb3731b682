"""The wire protocol between the master and worker groups: length-prefixed frames over TCP.

Three layers, one module each: :mod:`~worker.protocol.frames` (the bytes of a message),
:mod:`~worker.protocol.connection` (sending and receiving whole frames on a socket) and
:mod:`~worker.protocol.handshake` (proving both ends hold the run secret). Import from here.
"""

from worker.protocol.connection import Connection, dial
from worker.protocol.frames import (DTYPES, HEADER, HEADER_SIZE, MAGIC, MAX_META_BYTES, META_LEN, NONCE_BYTES,
                                    PREAUTH_MAX_FRAME, PROTOCOL_VERSION, Message, MsgType, PeerClosed, ProtocolError,
                                    all_finite, decode_payload, encode, encode_parts, parse_header, parse_meta)
from worker.protocol.handshake import client_handshake, server_handshake, server_welcome

__all__ = ["DTYPES", "HEADER", "HEADER_SIZE", "MAGIC", "MAX_META_BYTES", "META_LEN", "NONCE_BYTES", "PREAUTH_MAX_FRAME",
           "PROTOCOL_VERSION", "Connection", "Message", "MsgType", "PeerClosed", "ProtocolError", "all_finite",
           "client_handshake", "decode_payload", "dial", "encode", "encode_parts", "parse_header", "parse_meta",
           "server_handshake", "server_welcome"]
