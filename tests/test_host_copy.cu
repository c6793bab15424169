/* bk_host_copy_parts (cuda/mem.cu: the host side of the GPU uploads' F32
 * staging and of the pinned codes download) on the host, no GPU needed
 * (suite cpu): every byte copied for sizes around the part boundaries and
 * 1..64 parts (and out-of-range part counts), nothing written past the end. */
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../cuda/cuda_internal.cuh"

int main()
{
    const size_t sizes[] = {0, 1, 3, 63, 64, 65, 4096, 100003, (size_t)5 << 20};
    const int parts[] = {-3, 0, 1, 2, 3, 7, 16, 64, 65, 1000};
    int fail = 0, cases = 0;
    for (size_t bytes : sizes)
        for (int np : parts) {
            std::vector<char> src(bytes + 1), dst(bytes + 16, (char)0x5a);
            for (size_t i = 0; i < bytes; i++)
                src[i] = (char)(i * 2654435761u >> 13);
            bk_host_copy_parts(dst.data(), src.data(), bytes, np);
            cases++;
            if (bytes && memcmp(dst.data(), src.data(), bytes) != 0) {
                printf("FAIL: %zu bytes in %d parts: contents differ\n", bytes, np);
                fail = 1;
            }
            for (size_t i = bytes; i < bytes + 16; i++)
                if (dst[i] != (char)0x5a) {
                    printf("FAIL: %zu bytes in %d parts: byte %zu past the end written\n", bytes,
                           np, i);
                    fail = 1;
                    break;
                }
        }
    printf("%s (%d cases)\n", fail ? "FAILED" : "ok", cases);
    return fail;
}
