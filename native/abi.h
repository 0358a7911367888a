/* What a library tells the Python side about its ABI, so that the ctypes mirrors of its structs and the numbers
 * both sides give to states, ids and limits are checked against the compiled code (glm53/native/abi.py), not
 * against the source text. Each header of a library declares one lookup, <prefix>_abi(name, &value), over a
 * table of
 *
 *   "struct_name"          sizeof the struct
 *   "struct_name.field"    offsetof the field
 *   "CONSTANT_NAME"        a #define or enum member, e.g. "GLM53_CE_ISA_AVX2"
 *
 * returning 0 when it knows the name and -1 when it does not. Each header's table is generated from it
 * (<header>_abi.inc, by glm53/native/bindgen.py). Included by C++ and by CUDA sources.
 */
#ifndef GLM53_ABI_H
#define GLM53_ABI_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct glm53_abi_entry {
    const char* name;
    int64_t value;
} glm53_abi_entry;

#define GLM53_ABI_SIZE(S) {#S, (int64_t) sizeof(S)}
#define GLM53_ABI_FIELD(S, f) {#S "." #f, (int64_t) offsetof(S, f)}
#define GLM53_ABI_CONSTANT(c) {#c, (int64_t) (c)}

static inline int glm53_abi_lookup(const glm53_abi_entry* table, size_t n, const char* name, int64_t* value)
{
    for (size_t i = 0; i < n; ++i)
        if (strcmp(table[i].name, name) == 0) {
            *value = table[i].value;
            return 0;
        }
    return -1;
}

#endif
