"""Stack tags (Besnard et al.): ``T = MIX(T, id(callee))``, ``MIX(A, B) = (A * 11) xor B`` mod 2**64.

A baseline for the comparison table, not a production mode: tags collide, and decoding is a
search over graph paths.  Function ids are 64-bit hashes (the paper hashes the function name; the
node id is mixed in so that two static functions sharing a name still get different ids).
"""

from __future__ import annotations

import hashlib

from ccprofd.encode.bits import WORD_MASK
from ccprofd.encode.edges import EdgeArrays

MIX_FACTOR = 11
# 11 is odd, hence invertible modulo 2**64: the decoder walks the chain backwards with it.
MIX_INVERSE = pow(MIX_FACTOR, -1, 1 << 64)


def mix(tag: int, ident: int) -> int:
    return ((tag * MIX_FACTOR) & WORD_MASK) ^ ident


def unmix(tag: int, ident: int) -> int:
    """The tag before ``mix(·, ident)`` produced ``tag``."""
    return ((tag ^ ident) * MIX_INVERSE) & WORD_MASK


def function_id(node: int, name: str) -> int:
    digest = hashlib.blake2b(f"{node}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def build_stacktags(ea: EdgeArrays, names: list[str]) -> list[int]:
    """Per dense node its 64-bit function id."""
    return [function_id(node, name) for node, name in zip(ea.nodes, names, strict=True)]
