/*
 * fuzz — the entry point shared by the libFuzzer harness and the plain corpus
 * replay driver (replay.c), so that every corpus file runs through exactly the
 * code libFuzzer ran, in every build (gcc, ASan+UBSan) and without clang.
 */
#ifndef KVBLEND_TESTS_FUZZ_H
#define KVBLEND_TESTS_FUZZ_H

#include <stddef.h>
#include <stdint.h>

/*
 * Feed one input. Returns 0 (libFuzzer's contract); a defect aborts the process
 * (sanitizer report, or abort() after a message on stderr when an invariant fails).
 */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif
