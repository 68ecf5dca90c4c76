#include "llama-polykv.h"

#include "llama.h"

const char * llama_polykv_version(void) {
    return LLAMA_POLYKV_VERSION;
}

const char * llama_polykv_llama_commit(void) {
    return LLAMA_POLYKV_LLAMA_COMMIT;
}
