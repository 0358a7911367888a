"""GPT-2's byte-level BPE alphabet, which GLM's tokenizer uses: in the vocabulary's token strings every byte
value stands as one printable character."""

from __future__ import annotations


def byte_alphabet() -> list[str]:
    """The printable character standing for each byte value 0..255.

    Bytes that are printable Latin-1 characters (other than space and soft hyphen) stand for themselves; the
    rest take the code points from 256 on, in byte order (so space, byte 32, is ``Ġ``).
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars
