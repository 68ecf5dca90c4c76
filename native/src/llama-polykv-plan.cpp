#include "llama-polykv-plan.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
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
    return selection != LLAMA_POLYKV_SELECT_LAYER && (needs_scores() || pattern == LLAMA_POLYKV_KNORM);
}

int32_t llama_polykv_adaptive_floor(int32_t budget) {
    return std::max(1, budget / LLAMA_POLYKV_ADAPTIVE_FLOOR_DIV); // a head without keys would attend to nothing
}

int32_t llama_polykv_adaptive_cap(int32_t budget, int32_t n_head_kv) {
    const int64_t cap = (int64_t) n_head_kv * budget - (int64_t) (n_head_kv - 1) * llama_polykv_adaptive_floor(budget);
    return (int32_t) std::min<int64_t>(cap, INT32_MAX);
}

// The rules are those of Plan.from_dict + Plan.validate in polykv_cpp/plan.py (docs/plan-format.md): both
// parsers accept and refuse the same texts (scripts/fuzz_plans.py checks it on mutated plans)

static void check_keys(const json & obj, std::initializer_list<const char *> allowed, const std::string & where) {
    std::string unknown;
    int n_unknown = 0;
    for (auto it = obj.begin(); it != obj.end(); ++it) {
        bool ok = false;
        for (const char * k : allowed) {
            ok = ok || it.key() == k;
        }
        if (!ok) {
            unknown += (n_unknown++ ? ", \"" : "\"") + it.key() + "\"";
        }
    }
    if (n_unknown > 0) {
        throw std::runtime_error(where + ": unknown field(s) " + unknown);
    }
}

// an optional integer field: absent or null gives def; otherwise an integer within [lo, INT32_MAX]
static int32_t get_int(const json & obj, const char * key, int32_t def, const std::string & where, int64_t lo = 0) {
    if (!obj.contains(key) || obj.at(key).is_null()) {
        return def;
    }
    const auto & v = obj.at(key);
    if (!v.is_number_integer()) {
        throw std::runtime_error(where + ": '" + key + "' must be an integer");
    }
    if (v.is_number_unsigned() && v.get<uint64_t>() > (uint64_t) INT32_MAX) {
        throw std::runtime_error(where + ": '" + key + "' is too large (at most 2147483647)");
    }
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > INT32_MAX) {
        throw std::runtime_error(where + ": '" + key + "' must be in [" + std::to_string(lo) + ", 2147483647] (got " +
                                 std::to_string(x) + ")");
    }
    return (int32_t) x;
}

static int32_t req_int(const json & obj, const char * key, const std::string & where, int64_t lo) {
    if (!obj.contains(key)) {
        throw std::runtime_error(where + ": missing '" + key + "'");
    }
    if (obj.at(key).is_null()) {
        throw std::runtime_error(where + ": '" + key + "' must be an integer");
    }
    return get_int(obj, key, 0, where, lo);
}

static void check_provenance(const json & pj, int32_t n_layer) {
    if (pj.is_null()) {
        return;
    }
    if (!pj.is_object()) {
        throw std::runtime_error("provenance must be an object");
    }
    check_keys(pj, { "model", "calibration", "signals", "date", "tool_version", "extra" }, "provenance");
    if (pj.contains("model") && !pj.at("model").is_null()) {
        const auto & m = pj.at("model");
        if (!m.is_object()) {
            throw std::runtime_error("provenance.model must be an object");
        }
        check_keys(m, { "name", "arch", "n_layer", "n_head", "n_head_kv", "head_dim", "n_vocab" }, "provenance.model");
        for (const char * k : { "n_layer", "n_head", "n_head_kv", "head_dim", "n_vocab" }) {
            if (m.contains(k) && !m.at(k).is_null() && !m.at(k).is_number_integer()) {
                throw std::runtime_error(std::string("provenance.model.") + k + " must be an integer");
            }
        }
        for (const char * k : { "name", "arch" }) {
            if (m.contains(k) && !m.at(k).is_null() && !m.at(k).is_string()) {
                throw std::runtime_error(std::string("provenance.model.") + k + " must be a string");
            }
        }
        if (m.contains("n_layer") && !m.at("n_layer").is_null() &&
            !(m.at("n_layer").is_number_integer() && !m.at("n_layer").is_number_unsigned() ? m.at("n_layer").get<int64_t>() == n_layer
                                                                                         : m.at("n_layer").get<uint64_t>() == (uint64_t) n_layer)) {
            throw std::runtime_error("provenance says the model has another number of layers than the plan");
        }
    }
    if (pj.contains("calibration") && !pj.at("calibration").is_null() && !pj.at("calibration").is_string() &&
        !pj.at("calibration").is_object()) {
        throw std::runtime_error("provenance.calibration must be a string or an object");
    }
    if (pj.contains("signals") && !pj.at("signals").is_null()) {
        const auto & sj = pj.at("signals");
        bool ok = sj.is_array();
        for (size_t i = 0; ok && i < sj.size(); ++i) {
            ok = sj.at(i).is_string();
        }
        if (!ok) {
            throw std::runtime_error("provenance.signals must be a list of strings");
        }
    }
    for (const char * k : { "date", "tool_version" }) {
        if (pj.contains(k) && !pj.at(k).is_null() && !pj.at(k).is_string()) {
            throw std::runtime_error(std::string("provenance.") + k + " must be a string");
        }
    }
    if (pj.contains("extra") && !pj.at("extra").is_null() && !pj.at("extra").is_object()) {
        throw std::runtime_error("provenance.extra must be an object");
    }
}

static void parse_phase(const json & pj, llama_polykv_phase_plan & pp, int32_t b_min, const std::string & where) {
    if (!pj.is_object()) {
        throw std::runtime_error(where + ": expected an object");
    }
    check_keys(pj, { "pattern", "budget", "share", "selection", "n_sink", "window", "obs_window", "pool_kernel",
                     "pool_shift" }, where);
    if (!pj.contains("pattern") || !pj.at("pattern").is_string() ||
        !pattern_from_name(pj.at("pattern").get<std::string>(), pp.pattern)) {
        throw std::runtime_error(where + ": unknown pattern " + (pj.contains("pattern") ? pj.at("pattern").dump() : std::string("(none)")));
    }
    const bool full = pp.pattern == LLAMA_POLYKV_FULLKV;
    // types first, for every pattern
    const bool has_budget = pj.contains("budget") && !pj.at("budget").is_null() &&
                            !(pj.at("budget").is_string() && pj.at("budget").get<std::string>() == "full");
    if (has_budget && !pj.at("budget").is_number_integer()) {
        throw std::runtime_error(where + ": budget must be an integer number of tokens or \"full\"");
    }
    const bool has_share = pj.contains("share") && !pj.at("share").is_null();
    if (has_share && !pj.at("share").is_number()) {
        throw std::runtime_error(where + ": share must be a number");
    }
    for (const char * k : { "n_sink", "window", "obs_window", "pool_kernel", "pool_shift" }) {
        if (pj.contains(k) && !pj.at(k).is_null() && !pj.at(k).is_number_integer()) {
            throw std::runtime_error(where + ": " + k + " must be an integer");
        }
    }
    pp.selection = LLAMA_POLYKV_SELECT_LAYER;
    if (pj.contains("selection") && !pj.at("selection").is_null()) {
        const auto & sj = pj.at("selection");
        const std::string sel = sj.is_string() ? sj.get<std::string>() : std::string();
        if (sel == "head") {
            pp.selection = LLAMA_POLYKV_SELECT_HEAD;
        } else if (sel == "adaptive") {
            pp.selection = LLAMA_POLYKV_SELECT_ADAPTIVE;
        } else if (sel != "layer") {
            throw std::runtime_error(where + ": selection must be \"layer\", \"head\" or \"adaptive\"");
        }
    }
    pp.budget = -1;
    pp.share  = -1.0;
    if (full) {
        if (has_budget || has_share) {
            throw std::runtime_error(where + ": a fullkv layer keeps everything; its budget must be \"full\"/null and it has no share");
        }
        return; // FullKV reads no parameter
    }
    if (has_budget == has_share) {
        throw std::runtime_error(where + (has_budget ? ": give a budget or a share, not both" : ": needs a budget (tokens) or a share"));
    }
    if (has_budget) {
        pp.budget = get_int(pj, "budget", -1, where, 1);
        if (pp.budget < b_min) {
            throw std::runtime_error(where + ": budget " + std::to_string(pp.budget) + " is below b_min " + std::to_string(b_min));
        }
    } else {
        pp.share = pj.at("share").get<double>();
        if (!std::isfinite(pp.share) || pp.share < 0) {
            throw std::runtime_error(where + ": share must be a finite number >= 0");
        }
    }
    const bool obs = pp.pattern == LLAMA_POLYKV_SNAPKV || pp.pattern == LLAMA_POLYKV_PYRAMIDKV;
    if (obs && (!pj.contains("obs_window") || pj.at("obs_window").is_null())) {
        throw std::runtime_error(where + ": needs obs_window (the observation window)");
    }
    pp.n_sink      = get_int(pj, "n_sink", 0, where, 0);
    pp.window      = get_int(pj, "window", 0, where, 0);
    pp.obs_window  = get_int(pj, "obs_window", 32, where, 1);
    pp.pool_kernel = get_int(pj, "pool_kernel", 1, where, 1);
    if (pp.pool_kernel % 2 == 0) {
        throw std::runtime_error(where + ": pool_kernel must be a positive odd number");
    }
    const int32_t reach = pp.pool_kernel / 2;
    pp.pool_shift = get_int(pj, "pool_shift", 0, where, -(int64_t) INT32_MAX);
    if (pp.pool_shift < -reach || pp.pool_shift > reach) {
        throw std::runtime_error(where + ": pool_shift must be from -" + std::to_string(reach) + " to " +
                                 std::to_string(reach) + " (pool_kernel / 2)");
    }
}

// n_sink + the recent tokens the pattern always keeps (as PhasePlan.reserved)
static int64_t reserved_tokens(const llama_polykv_phase_plan & pp, bool obs_given) {
    int64_t recent = pp.window;
    if ((pp.pattern == LLAMA_POLYKV_SNAPKV || pp.pattern == LLAMA_POLYKV_PYRAMIDKV) && obs_given) {
        recent = std::max<int64_t>(recent, pp.obs_window);
    }
    return (int64_t) pp.n_sink + recent;
}

static std::vector<int64_t> allocate_capped(const std::vector<long double> & w, int64_t pool, int32_t b_min,
                                            const std::vector<int32_t> & caps);

bool llama_polykv_plan_parse(const std::string & text, llama_polykv_plan & plan, std::string & err) {
    try {
        const json doc = json::parse(text);
        if (!doc.is_object()) {
            throw std::runtime_error("the plan must be a JSON object");
        }
        if (doc.contains("format") && !(doc.at("format").is_string() && doc.at("format").get<std::string>() == "polykv-plan")) {
            throw std::runtime_error("not a PolyKV plan (format must be \"polykv-plan\")");
        }
        if (!doc.contains("version") || !doc.at("version").is_number_integer()) {
            throw std::runtime_error("plan has no integer 'version'");
        }
        if (!(doc.at("version").is_number_unsigned() ? doc.at("version").get<uint64_t>() == 1 : doc.at("version").get<int64_t>() == 1)) {
            throw std::runtime_error("unsupported plan format version " + doc.at("version").dump() + " (this build reads version 1)");
        }
        check_keys(doc, { "format", "version", "n_layer", "budget_avg", "b_min", "budget_rule", "exact_total",
                          "full_charge", "followup", "stream", "prefill_slack", "allocation", "allocation_cap", "protect_tail",
                          "evict_every", "layers", "provenance" }, "plan");
        plan = llama_polykv_plan();
        plan.n_layer    = req_int(doc, "n_layer", "plan", 1);
        plan.budget_avg = req_int(doc, "budget_avg", "plan", 1);
        plan.b_min      = req_int(doc, "b_min", "plan", 0);
        if (plan.b_min > plan.budget_avg) {
            throw std::runtime_error("b_min " + std::to_string(plan.b_min) + " is larger than budget_avg " + std::to_string(plan.budget_avg));
        }
        if (!doc.contains("budget_rule") || !doc.at("budget_rule").is_string() || doc.at("budget_rule").get<std::string>().empty()) {
            throw std::runtime_error("plan: 'budget_rule' must be a non-empty string");
        }
        if (doc.contains("exact_total") && !doc.at("exact_total").is_boolean()) {
            throw std::runtime_error("plan: 'exact_total' must be true or false");
        }
        plan.exact_total = doc.value("exact_total", true);
        plan.full_charge = get_int(doc, "full_charge", -1, "plan", 1);
        if (doc.contains("followup")) {
            const auto & f = doc.at("followup");
            if (!f.is_string() || (f.get<std::string>() != "prefill" && f.get<std::string>() != "decode" && f.get<std::string>() != "keep")) {
                throw std::runtime_error("plan: 'followup' must be one of prefill, decode, keep (got " + f.dump() + ")");
            }
            plan.followup_decode = f.get<std::string>() == "decode";
            plan.followup_keep   = f.get<std::string>() == "keep";
        }
        if (doc.contains("stream")) {
            const auto & f = doc.at("stream");
            llama_polykv_pattern sp = LLAMA_POLYKV_FULLKV;
            if (!f.is_string() || !pattern_from_name(f.get<std::string>(), sp) || sp == LLAMA_POLYKV_FULLKV || sp == LLAMA_POLYKV_KVZIP) {
                throw std::runtime_error("plan: 'stream' must be a pattern that scores a prompt as it streams "
                                         "(streamingllm, h2o, snapkv, tova, pyramidkv, knorm, expected_attention; got " + f.dump() + ")");
            }
            plan.stream = sp;
        }
        if (doc.contains("prefill_slack")) {
            const auto & f = doc.at("prefill_slack");
            if (!f.is_number() || !std::isfinite(f.get<double>()) || f.get<double>() < 1.0 || f.get<double>() > 1e6) {
                throw std::runtime_error("plan: 'prefill_slack' must be a number from 1 to 1e6 (got " + f.dump() + ")");
            }
            plan.prefill_slack = (float) f.get<double>();
        }
        if (doc.contains("allocation")) {
            const auto & f = doc.at("allocation");
            if (!f.is_string() || (f.get<std::string>() != "plan" && f.get<std::string>() != "prompt" &&
                                   f.get<std::string>() != "prompt_median")) {
                throw std::runtime_error("plan: 'allocation' must be one of plan, prompt, prompt_median (got " +
                                         f.dump() + ")");
            }
            plan.allocation_prompt = f.get<std::string>() != "plan";
            plan.allocation_relative = f.get<std::string>() == "prompt_median";
        }
        if (doc.contains("allocation_cap") && !doc.at("allocation_cap").is_null()) {
            const auto & f = doc.at("allocation_cap");
            if (!f.is_number() || !std::isfinite(f.get<double>()) || f.get<double>() < 1.0 || f.get<double>() > 1e6) {
                throw std::runtime_error("plan: 'allocation_cap' must be a number from 1 to 1e6 (got " + f.dump() + ")");
            }
            if (!plan.allocation_prompt) {
                throw std::runtime_error("plan: 'allocation_cap' needs \"allocation\": \"prompt\" or \"prompt_median\"");
            }
            plan.allocation_cap = (float) f.get<double>();
        }
        plan.protect_tail = get_int(doc, "protect_tail", 0, "plan", 0);
        plan.evict_every  = get_int(doc, "evict_every", 1, "plan", 1);
        if (plan.evict_every > LLAMA_POLYKV_MAX_EVICT_EVERY) {
            throw std::runtime_error("plan: 'evict_every' must be in [1, " + std::to_string(LLAMA_POLYKV_MAX_EVICT_EVERY) +
                                     "] (got " + std::to_string(plan.evict_every) + ")");
        }
        if (!doc.contains("layers") || !doc.at("layers").is_array()) {
            throw std::runtime_error("plan: 'layers' must be a list");
        }
        const auto & layers = doc.at("layers");
        // the layers' own types are checked before their count and order, as Plan.from_dict does
        for (size_t i = 0; i < layers.size(); ++i) {
            const auto & lj = layers.at(i);
            const std::string where = "layers[" + std::to_string(i) + "]";
            if (!lj.is_object()) {
                throw std::runtime_error(where + ": expected an object");
            }
            check_keys(lj, { "layer", "prefill", "decode" }, where);
            if (!lj.contains("layer") || !lj.at("layer").is_number_integer()) {
                throw std::runtime_error(where + ": 'layer' must be an integer index");
            }
            for (const char * ph : { "prefill", "decode" }) {
                if (!lj.contains(ph)) {
                    throw std::runtime_error(where + ": missing '" + ph + "'");
                }
            }
        }
        check_provenance(doc.contains("provenance") ? doc.at("provenance") : json(), plan.n_layer);
        if ((int64_t) layers.size() != plan.n_layer) {
            throw std::runtime_error("plan: n_layer is " + std::to_string(plan.n_layer) + " but 'layers' has " + std::to_string(layers.size()) + " entries");
        }
        plan.layers.resize(plan.n_layer);
        std::array<std::vector<bool>, 2> obs_given = { std::vector<bool>(plan.n_layer), std::vector<bool>(plan.n_layer) };
        for (int32_t il = 0; il < plan.n_layer; ++il) {
            const auto & lj = layers.at(il);
            const auto & idx = lj.at("layer");
            if (idx.is_number_unsigned() ? idx.get<uint64_t>() != (uint64_t) il : idx.get<int64_t>() != il) {
                throw std::runtime_error("layer entry " + std::to_string(il) + " has index " + idx.dump() + "; layers must be listed in order");
            }
            const char * phase_names[2] = { "prefill", "decode" };
            for (int p = 0; p < 2; ++p) {
                const std::string where = "layer " + std::to_string(il) + " " + phase_names[p];
                parse_phase(lj.at(phase_names[p]), plan.layers[il][p], plan.b_min, where);
                const auto & pj = lj.at(phase_names[p]);
                obs_given[p][il] = pj.contains("obs_window") && !pj.at("obs_window").is_null();
                plan.layers[il][p].obs_given = obs_given[p][il];
            }
            const auto & lp = plan.layers[il];
            if (lp[1].prefill_only()) {
                throw std::runtime_error("layer " + std::to_string(il) + " decode: " + k_pattern_names[lp[1].pattern] +
                                         " scores a prompt once; it is a prefill pattern only");
            }
            const bool scored0 = lp[0].pattern != LLAMA_POLYKV_FULLKV && lp[0].pattern != LLAMA_POLYKV_STREAMINGLLM;
            const bool scored1 = lp[1].pattern != LLAMA_POLYKV_FULLKV && lp[1].pattern != LLAMA_POLYKV_STREAMINGLLM;
            if (scored0 && scored1 && lp[0].per_head() != lp[1].per_head()) {
                throw std::runtime_error("layer " + std::to_string(il) + ": one phase selects per head and the other per layer; a layer selects one way in both phases");
            }
        }
        // per phase: one form (budget or share), the total, and sinks + windows within each budget
        for (int p = 0; p < 2; ++p) {
            std::vector<int32_t> budgeted;
            int32_t n_share = 0;
            for (int32_t il = 0; il < plan.n_layer; ++il) {
                const auto & pp = plan.layers[il][p];
                if (pp.pattern != LLAMA_POLYKV_FULLKV) {
                    budgeted.push_back(il);
                    n_share += pp.share >= 0;
                }
            }
            if (budgeted.empty()) {
                continue;
            }
            const std::string ph = p == 0 ? "prefill" : "decode";
            if (n_share > 0 && n_share != (int32_t) budgeted.size()) {
                throw std::runtime_error(ph + ": layers mix 'budget' and 'share'; use one form per phase");
            }
            const int64_t n_full = plan.n_layer - (int64_t) budgeted.size();
            if (n_full > 0 && plan.full_charge < 0 && (n_share > 0 || plan.exact_total)) {
                throw std::runtime_error(ph + ": the plan has FullKV layers but no full_charge");
            }
            const int64_t pool = (int64_t) plan.n_layer * plan.budget_avg - n_full * std::max<int64_t>(plan.full_charge, 0);
            std::vector<int64_t> tokens(budgeted.size());
            if (n_share > 0) {
                long double total = 0;
                std::vector<long double> w;
                for (int32_t il : budgeted) {
                    w.push_back(plan.layers[il][p].share);
                    total += plan.layers[il][p].share;
                }
                if (std::fabs((double) total - 1.0) > 1e-6) {
                    throw std::runtime_error(ph + ": shares must sum to 1");
                }
                if (pool < (int64_t) budgeted.size() * plan.b_min) {
                    throw std::runtime_error(ph + ": the FullKV layers leave less than b_min for the others");
                }
                tokens = allocate_capped(w, pool - (int64_t) budgeted.size() * plan.b_min, plan.b_min,
                                         std::vector<int32_t>(budgeted.size(), 0));
            } else {
                int64_t got = 0;
                for (size_t k = 0; k < budgeted.size(); ++k) {
                    tokens[k] = plan.layers[budgeted[k]][p].budget;
                    got += tokens[k];
                }
                if (plan.exact_total && got != pool) {
                    throw std::runtime_error(ph + ": budgets sum to " + std::to_string(got) + ", expected " + std::to_string(pool) +
                                             " (n_layer*budget_avg less the FullKV charges; exact_total is set)");
                }
            }
            for (size_t k = 0; k < budgeted.size(); ++k) {
                const int32_t il = budgeted[k];
                const auto & pp = plan.layers[il][p];
                if (tokens[k] < 1) {
                    throw std::runtime_error("layer " + std::to_string(il) + " " + ph + ": budget " + std::to_string(tokens[k]) +
                                             " must be positive");
                }
                if (reserved_tokens(pp, obs_given[p][il]) > tokens[k]) {
                    throw std::runtime_error("layer " + std::to_string(il) + " " + ph + ": sinks + recent window exceed the budget " +
                                             std::to_string(tokens[k]));
                }
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
            if (budgets[i] > INT32_MAX) {
                err = "a KV budget of " + std::to_string(avg) + " tokens per layer gives layer " + std::to_string(budgeted[i]) +
                      " " + std::to_string(budgets[i]) + " tokens, more than a cache can index (2^31 - 1)";
                return false;
            }
        }
        // as Plan.scaled: every budget positive, the sinks within it, windows that no longer fit shrunk to what is left
        for (size_t i = 0; i < budgeted.size(); ++i) {
            auto & pp = plan.layers[budgeted[i]][p];
            auto where = [&]() {
                return "layer " + std::to_string(budgeted[i]) + (p == LLAMA_POLYKV_PHASE_PREFILL ? " prefill" : " decode");
            };
            if (budgets[i] < 1) {
                err = where() + ": a KV budget of " + std::to_string(avg) + " tokens per layer leaves it " +
                      std::to_string(budgets[i]) + " tokens; a budget must be positive";
                return false;
            }
            if (pp.n_sink > budgets[i]) {
                err = where() + ": n_sink " + std::to_string(pp.n_sink) + " does not fit the scaled budget " + std::to_string(budgets[i]);
                return false;
            }
            pp.budget = (int32_t) budgets[i];
            pp.share  = -1.0;
            const int32_t room = pp.budget - pp.n_sink;
            pp.window = std::min(pp.window, room);
            if (pp.obs_given && pp.obs_window > room) {
                pp.obs_window = std::max<int32_t>(1, room);
            }
        }
    }
    if (plan.protect_tail > 0) {
        // as Plan.tail_applied in polykv_cpp/plan.py
        for (int32_t il = 0; il < plan.n_layer; ++il) {
            for (int p = 0; p < 2; ++p) {
                auto & pp = plan.layers[il][p];
                if (pp.pattern == LLAMA_POLYKV_FULLKV || pp.budget < 0) {
                    continue;
                }
                int64_t b = (int64_t) pp.budget + plan.protect_tail;
                b = std::min<int64_t>(b, std::max<int64_t>(pp.budget, std::min<int64_t>(n_ctx, INT32_MAX)));
                const int32_t cap = caps.empty() ? 0 : caps[il];
                if (cap > 0) {
                    b = std::min<int64_t>(b, std::max<int64_t>(pp.budget, cap));
                }
                const int32_t grown = (int32_t) b - pp.budget;
                pp.budget = (int32_t) b;
                if (p == LLAMA_POLYKV_PHASE_PREFILL) {
                    pp.window = (int32_t) std::min<int64_t>((int64_t) pp.window + grown, pp.budget - pp.n_sink);
                }
            }
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
