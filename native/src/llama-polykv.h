#pragma once

// PolyKV (polykv-cpp): per-layer, per-phase KV-cache eviction driven by a stored plan.
// This header is internal to libllama; the public entry points are the llama_polykv_* functions in llama.h.

#define LLAMA_POLYKV_LLAMA_COMMIT "0c1e57098"

#ifndef LLAMA_POLYKV_VERSION
#define LLAMA_POLYKV_VERSION "dev"
#endif
