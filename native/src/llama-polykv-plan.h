#pragma once

// PolyKV plans (docs/plan-format.md): parsing and budget resolution, shared by the cache and the C API

#include <array>
#include <cstdint>
#include <string>
#include <vector>

enum llama_polykv_pattern {
    LLAMA_POLYKV_FULLKV,
    LLAMA_POLYKV_STREAMINGLLM,
    LLAMA_POLYKV_H2O,
    LLAMA_POLYKV_SNAPKV,
    LLAMA_POLYKV_TOVA,
    LLAMA_POLYKV_PYRAMIDKV,
    LLAMA_POLYKV_KNORM,
    LLAMA_POLYKV_KVZIP,  // prefill only: scored by a reconstruction pass (llama_polykv_compress_prompt_kvzip)
    LLAMA_POLYKV_EXPECTED_ATTENTION, // prefill only: scored by the statistics of the queries seen so far
};

// which unit keeps its own token set: the layer (all its KV heads share one set) or each KV head, with the same
// budget each (head) or with the layer's n_head_kv x budget split across its heads by score (adaptive, Ada-KV)
enum llama_polykv_selection {
    LLAMA_POLYKV_SELECT_LAYER    = 0,
    LLAMA_POLYKV_SELECT_HEAD     = 1,
    LLAMA_POLYKV_SELECT_ADAPTIVE = 2,
};

// adaptive selection: every KV head keeps at least its best max(1, budget / LLAMA_POLYKV_ADAPTIVE_FLOOR_DIV) tokens (Ada-KV's
// safeguard, 20% as kvpress's AdaKVPress), so one head holds at most what the others' floors leave of the layer's cells
#define LLAMA_POLYKV_ADAPTIVE_FLOOR_DIV 5

// the largest "evict_every" (polykv_cpp.plan.MAX_EVICT_EVERY)
#define LLAMA_POLYKV_MAX_EVICT_EVERY 65536
int32_t llama_polykv_adaptive_floor(int32_t budget);
int32_t llama_polykv_adaptive_cap(int32_t budget, int32_t n_head_kv);

enum llama_polykv_phase {
    LLAMA_POLYKV_PHASE_PREFILL = 0,
    LLAMA_POLYKV_PHASE_DECODE  = 1,
};

// one layer in one phase, with parameters as the reference (polykv_cpp.patterns.pattern_from_phase_plan) reads them
struct llama_polykv_phase_plan {
    llama_polykv_pattern pattern = LLAMA_POLYKV_FULLKV;

    int32_t budget      = -1;   // tokens kept; -1: everything (FullKV) or not resolved yet (share)
    double  share       = -1.0; // share of the pool above b_min, < 0 if the plan gives tokens
    int32_t n_sink      = 0;
    int32_t window      = 0;
    int32_t obs_window  = 32;
    bool    obs_given   = false; // obs_window given by the plan (a rescaled budget shrinks only a given one, as Plan.scaled)
    int32_t pool_kernel = 1;
    int32_t pool_shift  = 0;    // the pooling window moved back by this many places, |pool_shift| <= pool_kernel / 2

    llama_polykv_selection selection = LLAMA_POLYKV_SELECT_LAYER;

    bool needs_scores() const;
    // scored from the attention rows of the prompt's and decode's own queries (not KVzip's pass, not Expected
    // Attention's query statistics)
    bool reads_rows() const;
    // a pattern that scores a prompt only (KVzip, Expected Attention): never a decode pattern
    bool prefill_only() const;
    // a score- or key-based pattern selecting per KV head (positional patterns keep the same set in every head)
    bool per_head() const;
};

struct llama_polykv_plan {
    uint32_t version     = 1;
    int32_t  n_layer     = 0;
    int32_t  budget_avg  = 0;
    int32_t  b_min       = 1;
    bool     exact_total = true;
    int32_t  full_charge = -1;
    // "followup": "decode": tokens fed after the prompt was compressed (a question, the next turn) are merged in by
    // each layer's decode pattern at its prefill budget; false ("prefill", the default): by the prefill pattern
    bool     followup_decode = false;
    // "followup": "keep": tokens fed after the prompt was compressed (the question, the answer, a next turn) are never
    // evicted: the caches grow by them, as kvpress's pipeline compresses the context only
    bool     followup_keep = false;
    // "stream": a pattern (not fullkv, not kvzip): in chunked prefill, the layers whose prefill pattern is scored
    // evict by it while a prompt streams, before each new prompt ubatch, so that the prompt's last ubatch (the
    // question) reaches the prefill pattern whole, which compresses the prompt when decoding starts. -1: none
    int32_t  stream = -1;
    // "prefill_slack": the slack chunked prefill takes when neither the caller (llama_polykv_set_model_prefill_slack)
    // nor LLAMA_POLYKV_PREFILL_SLACK sets one (>= 1); 0: none given (slack 1)
    float    prefill_slack = 0.0f;
    // "allocation": "prompt": exact prefill re-splits the budgets of the scored layers for each prompt by their
    // scores across the model when it compresses the prompt (KVzip's non-uniform allocation; llama_kv_cache_poly::
    // allocate_prompt); false ("plan", the default): every layer keeps its plan budget
    bool     allocation_prompt = false;
    // "allocation": "prompt_median": the same, each token set's scores divided by the set's median before they compete
    // (a layer's tokens count by how far they stand above its typical token; polykv_cpp.patterns.relative_scores)
    bool     allocation_relative = false;
    // "allocation_cap": with a per-prompt allocation, a layer keeps at most ceil(cap x its plan budget) tokens per KV
    // head (>= 1; chunked prefill: also no more than it holds, budget x the slack); 0: no cap
    float    allocation_cap = 0.0f;
    // "protect_tail": the prompt's last protect_tail tokens are kept in every budgeted layer on top of its budget (the
    // question at the end of a prompt compressed whole): llama_polykv_plan_resolve adds them to each budgeted layer's
    // budgets (both phases, a sliding-window layer up to its window) and to its prefill window, after any rescaling
    int32_t  protect_tail = 0;
    // "evict_every": decode evicts a layer once it holds evict_every tokens more than its decode budget (per KV head;
    // an adaptive layer in all its heads together), not after every token; 1: after every token
    int32_t  evict_every = 1;

    std::vector<std::array<llama_polykv_phase_plan, 2>> layers; // [il][phase]
};

// parse plan format v1 (docs/plan-format.md); on failure returns false and sets err
bool llama_polykv_plan_parse(const std::string & json, llama_polykv_plan & plan, std::string & err);

// turn shares into tokens and, if kv_budget > 0, rescale the budgets to that average keeping b_min
// (largest remainder, as Plan.scaled in polykv_cpp/plan.py); FullKV layers are charged n_ctx.
// caps[il] > 0: layer il cannot hold more tokens (a sliding-window layer: its window); the tokens it cannot
// hold go to the other layers. Empty caps: no caps.
bool llama_polykv_plan_resolve(llama_polykv_plan & plan, int32_t kv_budget, uint32_t n_ctx, const std::vector<int32_t> & caps,
                               std::string & err);

// registry name of a pattern ("snapkv", ...; "unknown" out of range)
const char * llama_polykv_pattern_name(int32_t pattern);
