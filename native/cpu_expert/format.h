// The EXL3 tile format (mul1 codebook), as exllamav3 1.6.5 stores it and glm53/models/synth/exl3_reference.py
// decodes it:
//
// - trellis[kt][nt] is one 16x16 tile of K-bit codes: 16 K uint16 words, read as 8 K little-endian uint32 words
//   that form a tail-biting bit ring, most significant bit first.
// - State t (0..255) is the 16-bit window of the ring ending at bit (t + 1) K; it is the weight at tile row r
//   (along the input) and column c (along the output) where t = state_of(r, c), the tensor-core fragment order.
// - mul1: x = state * 0x83DCD12D (mod 2^32); the weight is (sum of x's four bytes - 510) * K_INV.
//
// Everything here has internal linkage: the header is compiled into every ISA's translation unit, each with
// its own instruction-set flags, and no copy may leak into another through a shared (weak) symbol.
#pragma once

#include <stdint.h>

namespace glm53ce {
namespace {

constexpr uint32_t MUL1_MULT = 0x83DCD12Du;
constexpr int MUL1_CENTER = 510;           // byte sums run 0..1020
constexpr float K_INV = 0.00676727294921875f;  // fp16 0x1eee, exactly
constexpr float HAD_SCALE = 0.0883883476483184405f;  // 1/sqrt(128), rounded to fp32
constexpr int BAND_TILES = 8;              // 128 output columns: one Hadamard block
constexpr int BAND_COLS = 16 * BAND_TILES;

constexpr int tile_bytes(int bits) { return 32 * bits; }
constexpr int ring_words(int bits) { return 8 * bits; }

// State at tile row r, column c: the inverse of exl3_reference.tc_perm.
constexpr int state_of(int r, int c)
{
    return 32 * (c % 8) + 4 * ((r & 7) & ~1) + 4 * (c / 8) + (r & 1) + 2 * (r >> 3);
}

// End of state t's window, one ring length on so that the window start stays positive.
constexpr int state_end(int bits, int t) { return (t + 1) * bits + 256 * bits; }

// Where a window lies in the ring of uint32 words: the words holding its first and last bit, and the right
// shift of (first << 32 | last) that brings the window to bits 15..0.
struct WordWindow {
    int first;
    int last;
    int shift;
};

constexpr WordWindow word_window(int bits, int t)
{
    const int end = state_end(bits, t);
    return WordWindow{((end - 16) >> 5) % ring_words(bits), ((end - 1) >> 5) % ring_words(bits),
                      (((end - 1) >> 5) + 1) * 32 - end};
}

// The ring's byte i in stream order (the most significant byte of word 0 first) sits at this memory offset.
constexpr int stream_byte(int bits, int i)
{
    const int j = i % tile_bytes(bits);
    return (j & ~3) + 3 - (j & 3);
}

inline uint32_t state_at(const uint32_t* ring, int bits, int t)
{
    const WordWindow w = word_window(bits, t);
    const uint64_t merged = (static_cast<uint64_t>(ring[w.first]) << 32) | ring[w.last];
    return static_cast<uint32_t>(merged >> w.shift) & 0xFFFFu;
}

// The codebook value of a state before the K_INV scale: an integer in -510..510, exact in fp32.
inline int mul1_centered(uint32_t state)
{
    const uint32_t x = state * MUL1_MULT;
    return static_cast<int>((x & 255u) + ((x >> 8) & 255u) + ((x >> 16) & 255u) + (x >> 24)) - MUL1_CENTER;
}

}  // namespace
}  // namespace glm53ce
