#include "llama-polykv-plan.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

using json = nlohmann::json;

//
// plan
//

static const char * k_pattern_names[] = {
    "fullkv", "streamingllm", "h2o", "snapkv", "tova", "pyramidkv", "knorm", "kvzip", "expected_attention",
};

static bool pattern_from_name(const std::string & name, llama_polykv_pattern & out) {
    for (int i = 0; i < (int) (sizeof(k_pattern_names)/sizeof(k_pattern_names[0])); ++i) {
        if (name == k_pattern_names[i]) {
            out = (llama_polykv_pattern) i;
            return true;
        }
    }
    return false;
}

bool llama_polykv_phase_plan::needs_scores() const {
    return pattern == LLAMA_POLYKV_H2O || pattern == LLAMA_POLYKV_SNAPKV ||
           pattern == LLAMA_POLYKV_TOVA || pattern == LLAMA_POLYKV_PYRAMIDKV || pattern == LLAMA_POLYKV_KVZIP ||
           pattern == LLAMA_POLYKV_EXPECTED_ATTENTION;
}

bool llama_polykv_phase_plan::reads_rows() const {
    return needs_scores() && !prefill_only();
}

bool llama_polykv_phase_plan::prefill_only() const {
    return pattern == LLAMA_POLYKV_KVZIP || pattern == LLAMA_POLYKV_EXPECTED_ATTENTION;
}

bool llama_polykv_phase_plan::per_head() const {
    return selection == LLAMA_POLYKV_SELECT_HEAD && (needs_scores() || pattern == LLAMA_POLYKV_KNORM);
}

static int32_t get_int(const json & obj, const char * key, int32_t def, const std::string & where) {
    if (!obj.contains(key) || obj.at(key).is_null()) {
        return def;
    }
    const auto & v = obj.at(key);
    if (!v.is_number_integer()) {
        throw std::runtime_error(where + ": '" + key + "' must be an integer");
    }
    const int64_t x = v.get<int64_t>();
    if (x < 0 || x > INT32_MAX) {
        throw std::runtime_error(where + ": '" + key + "' must be >= 0 (got " + std::to_string(x) + ")");
    }
    return (int32_t) x;
}

bool llama_polykv_plan_parse(const std::string & text, llama_polykv_plan & plan, std::string & err) {
    try {
        const json doc = json::parse(text);
        if (!doc.is_object()) {
            throw std::runtime_error("the plan must be a JSON object");
        }
        plan = llama_polykv_plan();
        plan.version = (uint32_t) get_int(doc, "version", 0, "plan");
        if (plan.version != 1) {
            throw std::runtime_error("unsupported plan format version " + std::to_string(plan.version) + " (this build reads version 1)");
        }
        plan.n_layer     = get_int(doc, "n_layer", 0, "plan");
        plan.budget_avg  = get_int(doc, "budget_avg", 0, "plan");
        plan.b_min       = get_int(doc, "b_min", 1, "plan");
        plan.full_charge = doc.contains("full_charge") && !doc.at("full_charge").is_null() ? get_int(doc, "full_charge", 0, "plan") : -1;
        plan.exact_total = doc.value("exact_total", true);
        if (!doc.contains("layers") || !doc.at("layers").is_array()) {
            throw std::runtime_error("plan: 'layers' must be a list");
        }
        const auto & layers = doc.at("layers");
        if ((int32_t) layers.size() != plan.n_layer) {
            throw std::runtime_error("plan: n_layer is " + std::to_string(plan.n_layer) + " but 'layers' has " + std::to_string(layers.size()) + " entries");
        }
        plan.layers.resize(plan.n_layer);
        std::vector<bool> seen(plan.n_layer, false);
        for (const auto & lj : layers) {
            const int32_t il = get_int(lj, "layer", -1, "plan layer");
            if (il < 0 || il >= plan.n_layer || seen[il]) {
                throw std::runtime_error("plan: bad or repeated layer index " + std::to_string(il));
            }
            seen[il] = true;
            const char * phase_names[2] = { "prefill", "decode" };
            for (int p = 0; p < 2; ++p) {
                const std::string where = "layer " + std::to_string(il) + " " + phase_names[p];
                if (!lj.contains(phase_names[p]) || !lj.at(phase_names[p]).is_object()) {
                    throw std::runtime_error(where + ": missing");
                }
                const auto & pj = lj.at(phase_names[p]);
                auto & pp = plan.layers[il][p];
                if (!pj.contains("pattern") || !pj.at("pattern").is_string() ||
                    !pattern_from_name(pj.at("pattern").get<std::string>(), pp.pattern)) {
                    throw std::runtime_error(where + ": unknown pattern " + (pj.contains("pattern") ? pj.at("pattern").dump() : std::string("(none)")));
                }
                pp.budget = -1;
                pp.share  = -1.0;
                if (pp.pattern != LLAMA_POLYKV_FULLKV) {
                    if (pj.contains("share") && !pj.at("share").is_null()) {
                        if (!pj.at("share").is_number() || pj.at("share").get<double>() < 0) {
                            throw std::runtime_error(where + ": share must be a number >= 0");
                        }
                        pp.share = pj.at("share").get<double>();
                    } else {
                        pp.budget = get_int(pj, "budget", -1, where);
                        if (pp.budget < 1) {
                            throw std::runtime_error(where + ": budget must be a positive number of tokens");
                        }
                    }
                }
                pp.n_sink      = get_int(pj, "n_sink", 0, where);
                pp.window      = get_int(pj, "window", 0, where);
                pp.obs_window  = get_int(pj, "obs_window", 32, where);
                pp.pool_kernel = get_int(pj, "pool_kernel", 1, where);
                if (pp.pool_kernel < 1 || pp.pool_kernel % 2 == 0) {
                    throw std::runtime_error(where + ": pool_kernel must be a positive odd number");
                }
                if (pj.contains("selection") && !pj.at("selection").is_null()) {
                    const auto & sj = pj.at("selection");
                    const std::string sel = sj.is_string() ? sj.get<std::string>() : std::string();
                    if (sel == "layer") {
                        pp.selection = LLAMA_POLYKV_SELECT_LAYER;
                    } else if (sel == "head") {
                        pp.selection = LLAMA_POLYKV_SELECT_HEAD;
                    } else {
                        throw std::runtime_error(where + ": selection must be \"layer\" or \"head\"");
                    }
                }
            }
            const auto & lp = plan.layers[il];
            if (lp[1].prefill_only()) {
                throw std::runtime_error("layer " + std::to_string(il) + " decode: " + k_pattern_names[lp[1].pattern] +
                                         " scores a prompt once; it is a prefill pattern only");
            }
            if (lp[0].per_head() && lp[1].per_head() == false && lp[1].pattern != LLAMA_POLYKV_FULLKV && lp[1].pattern != LLAMA_POLYKV_STREAMINGLLM) {
                throw std::runtime_error("layer " + std::to_string(il) + ": prefill selects per head but decode per layer; a layer selects one way in both phases");
            }
            if (lp[1].per_head() && lp[0].per_head() == false && lp[0].pattern != LLAMA_POLYKV_FULLKV && lp[0].pattern != LLAMA_POLYKV_STREAMINGLLM) {
                throw std::runtime_error("layer " + std::to_string(il) + ": decode selects per head but prefill per layer; a layer selects one way in both phases");
            }
        }
    } catch (const std::exception & e) {
        err = e.what();
        return false;
    }
    return true;
}

// split `total` over integer weights in proportion, exactly, by largest remainder (ties: lower index first)
static std::vector<int64_t> largest_remainder(const std::vector<long double> & w, int64_t total) {
    const size_t n = w.size();
    std::vector<int64_t> parts(n, 0);
    if (n == 0) {
        return parts;
    }
    long double s = 0;
    for (auto x : w) {
        s += x;
    }
    std::vector<long double> quota(n);
    for (size_t i = 0; i < n; ++i) {
        quota[i] = s > 0 ? (long double) total * w[i] / s : (long double) total / n;
        parts[i] = (int64_t) std::floor(quota[i]);
    }
    int64_t left = total - std::accumulate(parts.begin(), parts.end(), (int64_t) 0);
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        return (quota[a] - parts[a]) > (quota[b] - parts[b]);
    });
    for (size_t k = 0; k < n && left > 0; ++k, --left) {
        parts[order[k]] += 1;
    }
    return parts;
}

// b_min + a largest-remainder share of pool for each layer; a layer whose budget would pass its cap (cap > 0) is
// fixed at the cap and the pool left is split again over the others (as allocate_budgets in polykv_cpp/plan.py)
static std::vector<int64_t> allocate_capped(const std::vector<long double> & w, int64_t pool, int32_t b_min,
                                            const std::vector<int32_t> & caps) {
    const size_t n = w.size();
    std::vector<int64_t> budget(n, b_min);
    std::vector<bool> fixed(n, false);
    while (true) {
        std::vector<size_t> open;
        std::vector<long double> w_open;
        for (size_t i = 0; i < n; ++i) {
            if (!fixed[i]) {
                open.push_back(i);
                w_open.push_back(w[i]);
            }
        }
        if (open.empty()) {
            return budget;
        }
        const auto parts = largest_remainder(w_open, pool);
        bool capped = false;
        for (size_t k = 0; k < open.size(); ++k) {
            const size_t i = open[k];
            if (caps[i] > 0 && b_min + parts[k] > caps[i]) {
                fixed[i]  = true;
                budget[i] = std::max<int64_t>(b_min, caps[i]);
                pool     -= budget[i] - b_min;
                capped    = true;
            }
        }
        if (!capped) {
            for (size_t k = 0; k < open.size(); ++k) {
                budget[open[k]] = b_min + parts[k];
            }
            return budget;
        }
    }
}

bool llama_polykv_plan_resolve(llama_polykv_plan & plan, int32_t kv_budget, uint32_t n_ctx, const std::vector<int32_t> & caps,
                               std::string & err) {
    for (int p = 0; p < 2; ++p) {
        std::vector<int32_t> budgeted;
        int32_t n_full = 0;
        bool shares = false;
        for (int32_t il = 0; il < plan.n_layer; ++il) {
            const auto & pp = plan.layers[il][p];
            if (pp.pattern == LLAMA_POLYKV_FULLKV) {
                n_full++;
            } else {
                budgeted.push_back(il);
                shares |= pp.share >= 0;
            }
        }
        if (budgeted.empty()) {
            continue;
        }
        if (!shares && kv_budget <= 0) {
            continue; // the plan gives tokens and no rescaling is asked for
        }
        const int64_t avg    = kv_budget > 0 ? kv_budget : plan.budget_avg;
        const int64_t charge = kv_budget > 0 ? (int64_t) n_ctx : (plan.full_charge >= 0 ? plan.full_charge : (int64_t) n_ctx);
        const int64_t pool   = (int64_t) plan.n_layer * avg - n_full * charge - (int64_t) budgeted.size() * plan.b_min;
        if (pool < 0) {
            err = "a KV budget of " + std::to_string(avg) + " tokens per layer cannot fit: " + std::to_string(budgeted.size()) +
                  " layers need b_min=" + std::to_string(plan.b_min) + " each and " + std::to_string(n_full) +
                  " FullKV layers are charged " + std::to_string(charge) + " tokens each";
            return false;
        }
        std::vector<long double> w;
        std::vector<int32_t> layer_caps;
        for (int32_t il : budgeted) {
            const auto & pp = plan.layers[il][p];
            w.push_back(pp.share >= 0 ? (long double) pp.share : (long double) std::max(0, pp.budget - plan.b_min));
            layer_caps.push_back(caps.empty() ? 0 : caps[il]);
        }
        const auto budgets = allocate_capped(w, pool, plan.b_min, layer_caps);
        for (size_t i = 0; i < budgeted.size(); ++i) {
            plan.layers[budgeted[i]][p].budget = (int32_t) budgets[i];
            plan.layers[budgeted[i]][p].share  = -1.0;
        }
    }
    return true;
}

const char * llama_polykv_pattern_name(int32_t pattern) {
    if (pattern < 0 || pattern > LLAMA_POLYKV_EXPECTED_ATTENTION) {
        return "unknown";
    }
    return k_pattern_names[pattern];
}
