// libFuzzer harness for the PolyKV plan parser and budget resolution (issue 16): every plan a model file, the
// LLAMA_POLYKV_PLAN file or llama_polykv_set_model_plan hands the library goes through llama_polykv_plan_parse, and
// a context then resolves it with llama_polykv_plan_resolve for its n_ctx, its KV budget and the model's
// sliding-window caps. Besides crashes and sanitizer reports, the harness aborts when a plan the parser accepted
// breaks what the cache relies on (docs/plan-format.md), before or after resolution.
//
// Build and run: scripts/fuzz_native.sh

#include "llama-polykv-plan.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static void expect(bool ok, const char * what, int32_t il = -1, int p = -1) {
    if (!ok) {
        fprintf(stderr, "fuzz-plan: broken invariant: %s (layer %d, phase %d)\n", what, il, p);
        abort();
    }
}

static void check_parsed(const llama_polykv_plan & plan) {
    expect(plan.n_layer >= 1 && (size_t) plan.n_layer == plan.layers.size(), "n_layer matches the layers");
    expect(plan.budget_avg >= 1 && plan.b_min >= 0 && plan.b_min <= plan.budget_avg, "b_min <= budget_avg");
    expect(plan.protect_tail >= 0, "protect_tail >= 0");
    for (int32_t il = 0; il < plan.n_layer; ++il) {
        for (int p = 0; p < 2; ++p) {
            const auto & pp = plan.layers[il][p];
            expect(pp.pattern >= LLAMA_POLYKV_FULLKV && pp.pattern <= LLAMA_POLYKV_EXPECTED_ATTENTION, "known pattern", il, p);
            if (pp.pattern == LLAMA_POLYKV_FULLKV) {
                expect(pp.budget == -1 && pp.share < 0, "a FullKV layer has no budget", il, p);
                continue;
            }
            const bool tokens = pp.budget >= 0;
            const bool share  = pp.share >= 0;
            expect(tokens != share, "a budget or a share", il, p);
            expect(!tokens || (pp.budget >= 1 && pp.budget >= plan.b_min), "budget >= max(1, b_min)", il, p);
            expect(!share || std::isfinite(pp.share), "a finite share", il, p);
            expect(pp.n_sink >= 0 && pp.window >= 0 && pp.obs_window >= 1, "sinks, windows >= 0", il, p);
            expect(pp.pool_kernel >= 1 && pp.pool_kernel % 2 == 1, "odd pool kernel", il, p);
            expect(!tokens || (int64_t) pp.n_sink + pp.window <= pp.budget, "sinks + window within the budget", il, p);
            expect(p == LLAMA_POLYKV_PHASE_PREFILL || !pp.prefill_only(), "no prefill-only decode pattern", il, p);
        }
    }
}

// the budgets a context gets, for one n_ctx, KV budget and set of sliding-window caps
static void check_resolved(const llama_polykv_plan & parsed, int32_t kv_budget, uint32_t n_ctx, const std::vector<int32_t> & caps) {
    llama_polykv_plan plan = parsed;
    std::string err;
    if (!llama_polykv_plan_resolve(plan, kv_budget, n_ctx, caps, err)) {
        expect(!err.empty(), "a refused resolution says why");
        return;
    }
    for (int p = 0; p < 2; ++p) {
        int64_t sum    = 0;
        int32_t n_full = 0;
        bool    capped = false;
        for (int32_t il = 0; il < plan.n_layer; ++il) {
            const auto & pp = plan.layers[il][p];
            if (pp.pattern == LLAMA_POLYKV_FULLKV) {
                n_full++;
                continue;
            }
            expect(pp.share < 0, "every share became tokens", il, p);
            expect(pp.budget >= 1, "a resolved budget keeps at least one token", il, p);
            expect(pp.budget >= plan.b_min, "a resolved budget keeps b_min", il, p);
            expect(pp.n_sink >= 0 && pp.window >= 0, "sinks, windows >= 0 after resolution", il, p);
            expect((int64_t) pp.n_sink + pp.window <= pp.budget, "sinks + window within the budget after resolution", il, p);
            expect(kv_budget <= 0 || !pp.obs_given || pp.obs_window <= std::max(1, pp.budget - pp.n_sink),
                   "a rescaled plan's given observation windows within its budgets (as Plan.scaled)", il, p);
            capped |= !caps.empty() && caps[il] > 0;
            sum += pp.budget;
        }
        if (kv_budget > 0 && plan.protect_tail == 0 && sum > 0) {
            const int64_t total = (int64_t) plan.n_layer * kv_budget - (int64_t) n_full * n_ctx;
            expect(capped ? sum <= std::max<int64_t>(total, (int64_t) (plan.n_layer - n_full) * plan.b_min) : sum == total,
                   "the rescaled budgets add up to n_layer x kv_budget less the FullKV layers");
        }
    }
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string text((const char *) data, size);
    llama_polykv_plan plan;
    std::string err;
    if (!llama_polykv_plan_parse(text, plan, err)) {
        expect(!err.empty(), "a refused plan says why");
        return 0;
    }
    check_parsed(plan);
    // Gemma-3-like caps: five sliding-window layers of 512 tokens for each global one
    std::vector<int32_t> swa(plan.n_layer, 0);
    for (int32_t il = 0; il < plan.n_layer; ++il) {
        swa[il] = il % 6 == 5 ? 0 : 512;
    }
    for (int32_t kv_budget : { 0, 1, 64, 4096, INT32_MAX }) {
        for (uint32_t n_ctx : { 256u, 131072u }) {
            check_resolved(plan, kv_budget, n_ctx, {});
            check_resolved(plan, kv_budget, n_ctx, swa);
        }
    }
    return 0;
}
