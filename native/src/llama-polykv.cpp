#include "llama-polykv.h"

#include "llama-impl.h"
#include "llama-batch.h"
#include "llama-context.h"
#include "llama-cparams.h"
#include "llama-io.h"
#include "llama-model.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <sstream>
#include <stdexcept>

using json = nlohmann::json;

//
// plan
//

static const char * k_pattern_names[] = {
    "fullkv", "streamingllm", "h2o", "snapkv", "tova", "pyramidkv", "knorm",
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
           pattern == LLAMA_POLYKV_TOVA || pattern == LLAMA_POLYKV_PYRAMIDKV;
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

//
// model-level plan overrides (C API) and plan lookup
//

struct polykv_override {
    std::string json;
    int32_t kv_budget = 0;
};

static std::mutex g_mutex;
static std::map<const llama_model *, polykv_override> g_overrides;
static std::map<const llama_model *, int32_t> g_prefill_mode;
static std::map<const llama_model *, float> g_prefill_slack;

// portable prefill keeps the last rows of this many queries (SnapKV/PyramidKV plans read at most this many)
static const int32_t POLYKV_PORTABLE_OBS_WINDOW = 64;
static std::string g_last_error;

static void set_last_error(const std::string & msg) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_last_error = msg;
}

static std::string model_meta_str(const llama_model & model, const char * key) {
    std::vector<char> buf(256);
    int32_t n = llama_model_meta_val_str(&model, key, buf.data(), buf.size());
    if (n < 0) {
        return "";
    }
    if ((size_t) n >= buf.size()) {
        buf.resize(n + 1);
        n = llama_model_meta_val_str(&model, key, buf.data(), buf.size());
    }
    return std::string(buf.data(), n);
}

static bool read_text_file(const std::string & path, std::string & out) {
    std::ifstream f(path, std::ios::binary);
    if (!f) {
        return false;
    }
    std::stringstream ss;
    ss << f.rdbuf();
    out = ss.str();
    return true;
}

// the plan text for a model and where it came from; empty if none applies
static std::string find_plan(const llama_model & model, int32_t & kv_budget, std::string & source) {
    kv_budget = 0;
    if (const char * env = getenv("LLAMA_POLYKV_KV_BUDGET")) {
        kv_budget = atoi(env);
    }
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_overrides.find(&model);
        if (it != g_overrides.end()) {
            if (it->second.kv_budget > 0) {
                kv_budget = it->second.kv_budget;
            }
            source = "set by llama_polykv_set_model_plan";
            return it->second.json; // an empty override disables the plan
        }
    }
    if (const char * env = getenv("LLAMA_POLYKV_DISABLE")) {
        if (atoi(env) != 0) {
            return "";
        }
    }
    if (const char * path = getenv("LLAMA_POLYKV_PLAN")) {
        std::string text;
        if (!read_text_file(path, text)) {
            throw std::runtime_error(std::string("PolyKV: cannot read the plan file LLAMA_POLYKV_PLAN=") + path);
        }
        source = std::string("file ") + path;
        return text;
    }
    std::string text = model_meta_str(model, "polykv.plan");
    if (!text.empty()) {
        source = "GGUF key polykv.plan";
    }
    return text;
}

//
// llama_kv_cache_poly
//

static uint32_t pad_to(uint32_t x, uint32_t n) {
    return ((x + n - 1) / n) * n;
}

static bool same_phase(const llama_polykv_phase_plan & a, const llama_polykv_phase_plan & b) {
    return a.pattern == b.pattern && a.budget == b.budget && a.n_sink == b.n_sink && a.window == b.window;
}

llama_kv_cache_poly::llama_kv_cache_poly(
        const llama_model & model,
      const llama_hparams & hparams,
        llama_polykv_plan   plan_in,
                  int32_t   prefill_mode,
                    float   prefill_slack,
                ggml_type   type_k,
                ggml_type   type_v,
                     bool   v_trans,
                     bool   offload,
                 uint32_t   n_ctx,
                 uint32_t   n_ubatch) : model(model), hparams(hparams), plan(std::move(plan_in)), n_ctx(n_ctx),
                                        v_trans(v_trans), prefill_exact(prefill_mode != 0), portable(prefill_mode == 2),
                                        prefill_slack(prefill_mode == 0 ? std::max(1.0f, prefill_slack) : 1.0f) {
    const int32_t n_layer = (int32_t) hparams.n_layer();
    layer_group.assign(n_layer, -1);

    // group layers whose kept set is the same by construction (positional patterns with equal parameters);
    // every layer with a score-based or key-based pattern gets a group of its own
    for (int32_t il = 0; il < n_layer; ++il) {
        if (!hparams.has_kv(il)) {
            continue;
        }
        const auto & lp = plan.layers[il];
        const bool is_swa = hparams.is_swa(il);
        const bool positional = !lp[0].needs_scores() && !lp[1].needs_scores() &&
                                lp[0].pattern != LLAMA_POLYKV_KNORM && lp[1].pattern != LLAMA_POLYKV_KNORM;
        int32_t g_found = -1;
        if (positional && !portable) {
            for (size_t g = 0; g < groups.size(); ++g) {
                const auto & grp = groups[g];
                if (grp.is_swa == is_swa && !grp.needs_scores() && !grp.needs(LLAMA_POLYKV_KNORM) &&
                    same_phase(grp.phase[0], lp[0]) && same_phase(grp.phase[1], lp[1])) {
                    g_found = (int32_t) g;
                    break;
                }
            }
        }
        const bool per_head = lp[0].per_head() || lp[1].per_head();
        if (g_found < 0) {
            groups.emplace_back();
            groups.back().phase  = lp;
            groups.back().is_swa = is_swa;
            groups.back().collect_all = portable;
            groups.back().per_head = per_head;
            groups.back().n_head_kv = hparams.n_head_kv(il);
            g_found = (int32_t) groups.size() - 1;
        }
        groups[g_found].layers.push_back(il);
        layer_group[il] = g_found;
    }

    for (size_t g = 0; g < groups.size(); ++g) {
        auto & grp = groups[g];
        uint32_t cap = 0;
        for (int p = 0; p < 2; ++p) {
            const auto & pp = grp.phase[p];
            const bool whole_prompt = prefill_exact && p == LLAMA_POLYKV_PHASE_PREFILL;
            uint32_t keep = (pp.pattern == LLAMA_POLYKV_FULLKV || pp.budget < 0 || whole_prompt) ? n_ctx : (uint32_t) pp.budget;
            if (p == LLAMA_POLYKV_PHASE_PREFILL && keep < n_ctx) {
                keep = (uint32_t) streaming_phase(pp).budget;
            }
            if (grp.is_swa) {
                keep = std::min(keep, hparams.n_swa);
            }
            cap = std::max(cap, keep >= n_ctx ? n_ctx : keep + n_ubatch);
        }
        // on GPUs, multiples of 256 keep the fast flash-attention kernels usable; the CPU needs no padding
        uint32_t pad = 32;
        for (int32_t il : grp.layers) {
            if (offload && ggml_backend_dev_type(model.dev_layer(il)) != GGML_BACKEND_DEVICE_TYPE_CPU) {
                pad = 256;
            }
        }
        grp.capacity = std::min(n_ctx, pad_to(cap, pad));
        if (grp.per_head) {
            const int32_t il = grp.layers.front();
            if (hparams.n_embd_head_k(il) % ggml_blck_size(type_k) != 0 || hparams.n_embd_head_v(il) % ggml_blck_size(type_v) != 0) {
                throw std::runtime_error("PolyKV: layer " + std::to_string(il) + " selects per KV head, which needs a head size that is a "
                                         "multiple of the KV cache type's block size; use f16 or f32 K/V");
            }
        }

        std::vector<bool> member(n_layer, false);
        for (int32_t il : grp.layers) {
            member[il] = true;
        }
        const std::string tag = "_pkv" + std::to_string(g);
        grp.kv = std::make_unique<llama_kv_cache>(
                model, hparams, type_k, type_v, v_trans, offload, /*unified*/ true, grp.capacity,
                /*n_seq_max*/ 1, /*n_pad*/ 1, grp.is_swa ? hparams.n_swa : 0,
                grp.is_swa ? hparams.swa_type : LLAMA_SWA_TYPE_NONE, nullptr,
                [member](int32_t il) { return member[il]; }, nullptr, nullptr, tag.c_str());
        const size_t n_state = (size_t) grp.n_slots() * grp.capacity;
        grp.acc.assign(n_state, 0.0f);
        grp.last.assign(n_state, 0.0f);
        grp.knorm.assign(n_state, 0.0f);
        if (grp.per_head) {
            grp.hpos.assign((size_t) grp.n_head_kv * grp.capacity, -1);
        }
    }
}

llama_memory_context_ptr llama_kv_cache_poly::init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) {
    GGML_UNUSED(embd_all);

    balloc.split_reset();

    std::vector<llama_ubatch> ubatches;
    while (true) {
        auto ubatch = balloc.split_simple(n_ubatch);
        if (ubatch.n_tokens == 0) {
            break;
        }
        ubatches.push_back(std::move(ubatch)); // NOLINT
    }

    if (ubatches.empty() || balloc.get_n_used() < balloc.get_n_tokens()) {
        return std::make_unique<llama_kv_cache_poly_context>(LLAMA_MEMORY_STATUS_FAILED_PREPARE);
    }

    return std::make_unique<llama_kv_cache_poly_context>(this, std::move(ubatches));
}

llama_memory_context_ptr llama_kv_cache_poly::init_full() {
    return std::make_unique<llama_kv_cache_poly_context>(this);
}

llama_memory_context_ptr llama_kv_cache_poly::init_update(llama_context * lctx, bool optimize) {
    GGML_UNUSED(lctx);
    GGML_UNUSED(optimize);
    return std::make_unique<llama_kv_cache_poly_context>(LLAMA_MEMORY_STATUS_NO_UPDATE);
}

bool llama_kv_cache_poly::get_can_shift() const {
    // evicted layers keep absolute positions; a context shift would re-rotate them inconsistently
    return false;
}

void llama_kv_cache_poly::clear(bool data) {
    for (auto & grp : groups) {
        grp.kv->clear(data);
        std::fill(grp.acc.begin(), grp.acc.end(), 0.0f);
        std::fill(grp.last.begin(), grp.last.end(), 0.0f);
        std::fill(grp.knorm.begin(), grp.knorm.end(), 0.0f);
        std::fill(grp.hpos.begin(), grp.hpos.end(), -1);
        grp.ring.clear();
    }
}

bool llama_kv_cache_poly::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    bool res = true;
    for (auto & grp : groups) {
        if (grp.per_head && seq_id <= 0) {
            // the stock cells carry one label per cell; what each head holds is in hpos
            const llama_pos hi = p1 < 0 ? std::numeric_limits<llama_pos>::max() : p1;
            for (auto & p : grp.hpos) {
                if (p >= 0 && p >= std::max<llama_pos>(p0, 0) && p < hi) {
                    p = -1;
                }
            }
            repack(grp);
            continue;
        }
        res = grp.kv->seq_rm(seq_id, p0, p1) && res;
    }
    return res;
}

void llama_kv_cache_poly::seq_cp(llama_seq_id seq_id_src, llama_seq_id seq_id_dst, llama_pos p0, llama_pos p1) {
    for (auto & grp : groups) {
        grp.kv->seq_cp(seq_id_src, seq_id_dst, p0, p1);
    }
}

void llama_kv_cache_poly::seq_keep(llama_seq_id seq_id) {
    for (auto & grp : groups) {
        grp.kv->seq_keep(seq_id);
    }
}

void llama_kv_cache_poly::seq_add(llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos shift) {
    GGML_UNUSED(seq_id); GGML_UNUSED(p0); GGML_UNUSED(p1); GGML_UNUSED(shift);
    LLAMA_LOG_WARN("%s: PolyKV caches keep absolute positions; position shifts are not supported\n", __func__);
}

void llama_kv_cache_poly::seq_div(llama_seq_id seq_id, llama_pos p0, llama_pos p1, int d) {
    GGML_UNUSED(seq_id); GGML_UNUSED(p0); GGML_UNUSED(p1); GGML_UNUSED(d);
    LLAMA_LOG_WARN("%s: PolyKV caches keep absolute positions; position division is not supported\n", __func__);
}

llama_pos llama_kv_cache_poly::seq_pos_min(llama_seq_id seq_id) const {
    llama_pos res = -1;
    for (const auto & grp : groups) {
        const llama_pos p = grp.kv->seq_pos_min(seq_id);
        if (p >= 0 && (res < 0 || p < res)) {
            res = p;
        }
    }
    return res;
}

llama_pos llama_kv_cache_poly::seq_pos_max(llama_seq_id seq_id) const {
    llama_pos res = -1;
    for (const auto & grp : groups) {
        res = std::max(res, grp.kv->seq_pos_max(seq_id));
    }
    return res;
}

std::map<ggml_backend_buffer_type_t, size_t> llama_kv_cache_poly::memory_breakdown() const {
    std::map<ggml_backend_buffer_type_t, size_t> mb;
    for (const auto & grp : groups) {
        for (const auto & [buft, size] : grp.kv->memory_breakdown()) {
            mb[buft] += size;
        }
    }
    return mb;
}

size_t llama_kv_cache_poly::group_bytes(uint32_t g) const {
    size_t total = 0;
    for (const auto & [buft, size] : groups[g].kv->memory_breakdown()) {
        total += size;
    }
    return total;
}

static const uint32_t POLYKV_STATE_MAGIC = 0x504b5633; // "PKV3"

// after each group's cells: the score state of every kept token, keyed by position (a restore may place
// tokens in other cells), so that a restored cache goes on evicting as the saved one would have
void llama_kv_cache_poly::state_write(llama_io_write_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) const {
    const uint32_t n = groups.size();
    const uint8_t pending = prompt_pending ? 1 : 0;
    io.write(&POLYKV_STATE_MAGIC, sizeof(POLYKV_STATE_MAGIC));
    io.write(&n, sizeof(n));
    io.write(&pending, sizeof(pending));
    for (const auto & grp : groups) {
        io.write(&grp.capacity, sizeof(grp.capacity));
        grp.kv->state_write(io, seq_id, flags);

        const auto & cells = grp.kv->get_cells(0);
        std::vector<uint32_t> idxs;
        for (uint32_t i = 0; i < cells.size(); ++i) {
            if (!cells.is_empty(i)) {
                idxs.push_back(i);
            }
        }
        const uint32_t n_cells = idxs.size();
        const uint32_t n_ring  = grp.ring.size();
        io.write(&n_cells, sizeof(n_cells));
        io.write(&n_ring,  sizeof(n_ring));
        for (uint32_t i : idxs) {
            const llama_pos pos = cells.pos_get(i);
            io.write(&pos, sizeof(pos));
            io.write(&grp.acc[i],   sizeof(float));
            io.write(&grp.last[i],  sizeof(float));
            io.write(&grp.knorm[i], sizeof(float));
            for (const auto & row : grp.ring) {
                io.write(&row[i], sizeof(float));
            }
        }
        // per-head groups: what every head holds in each used cell, in cell order (a whole-cache restore puts the
        // k-th used cell at the k-th used cell again)
        // per-head positions only where a head holds other tokens than its cell's label (before any per-head
        // eviction, e.g. a portable prompt state, every head holds every cell and any plan may load it)
        bool heads_differ = false;
        for (uint32_t h = 0; grp.per_head && h < grp.n_head_kv; ++h) {
            for (uint32_t i : idxs) {
                heads_differ |= grp.hpos[(size_t) h*grp.capacity + i] != cells.pos_get(i);
            }
        }
        const uint8_t head_scores = grp.head_scores() ? 1 : 0;
        const uint8_t per_head    = heads_differ ? 1 : 0;
        io.write(&head_scores, sizeof(head_scores));
        io.write(&per_head, sizeof(per_head));
        if (grp.head_scores()) {
            for (uint32_t h = 0; h < grp.n_head_kv; ++h) {
                const size_t off = grp.head_off(h);
                for (uint32_t i : idxs) {
                    if (per_head) {
                        io.write(&grp.hpos[(size_t) h*grp.capacity + i], sizeof(llama_pos));
                    }
                    io.write(&grp.acc[off + i],   sizeof(float));
                    io.write(&grp.last[off + i],  sizeof(float));
                    io.write(&grp.knorm[off + i], sizeof(float));
                    for (const auto & row : grp.ring) {
                        io.write(&row[off + i], sizeof(float));
                    }
                }
            }
        }
    }
}

void llama_kv_cache_poly::state_read(llama_io_read_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) {
    uint32_t magic = 0;
    uint32_t n = 0;
    uint8_t  pending = 0;
    io.read(&magic, sizeof(magic));
    io.read(&n, sizeof(n));
    io.read(&pending, sizeof(pending));
    if (magic != POLYKV_STATE_MAGIC || n != groups.size()) {
        throw std::runtime_error("PolyKV: the saved state does not come from a context with the same plan "
                                 "(or, in portable prefill mode, from another portable context of this model)");
    }
    // a prompt saved before its compression is compressed at the next decode step (exact modes, slack)
    prompt_pending = compresses_at_decode() && pending != 0;
    for (auto & grp : groups) {
        uint32_t cap = 0;
        io.read(&cap, sizeof(cap));
        if (cap != grp.capacity) {
            throw std::runtime_error("PolyKV: the saved state has different cache sizes (plan, budget or context size changed)");
        }
        grp.kv->state_read(io, seq_id, flags);

        std::map<llama_pos, uint32_t> cell_of;
        const auto & cells = grp.kv->get_cells(0);
        for (uint32_t i = 0; i < cells.size(); ++i) {
            if (!cells.is_empty(i)) {
                cell_of[cells.pos_get(i)] = i;
            }
        }
        uint32_t n_cells = 0;
        uint32_t n_ring  = 0;
        io.read(&n_cells, sizeof(n_cells));
        io.read(&n_ring,  sizeof(n_ring));
        std::fill(grp.acc.begin(), grp.acc.end(), 0.0f);
        std::fill(grp.last.begin(), grp.last.end(), 0.0f);
        std::fill(grp.knorm.begin(), grp.knorm.end(), 0.0f);
        grp.ring.assign(n_ring, std::vector<float>((size_t) grp.n_slots() * grp.capacity, 0.0f));
        for (uint32_t k = 0; k < n_cells; ++k) {
            llama_pos pos = 0;
            float acc = 0.0f, last = 0.0f, knorm = 0.0f;
            io.read(&pos, sizeof(pos));
            io.read(&acc, sizeof(acc));
            io.read(&last, sizeof(last));
            io.read(&knorm, sizeof(knorm));
            std::vector<float> ring_vals(n_ring);
            for (auto & v : ring_vals) {
                io.read(&v, sizeof(v));
            }
            auto it = cell_of.find(pos);
            if (it == cell_of.end()) {
                continue;
            }
            const uint32_t c = it->second;
            grp.acc[c] = acc;
            grp.last[c] = last;
            grp.knorm[c] = knorm;
            for (uint32_t r = 0; r < n_ring; ++r) {
                grp.ring[r][c] = ring_vals[r];
            }
        }
        uint8_t head_scores = 0;
        uint8_t per_head = 0;
        io.read(&head_scores, sizeof(head_scores));
        io.read(&per_head, sizeof(per_head));
        // a cache evicted per head cannot continue under a per-layer plan; a per-head plan needs per-head scores,
        // which a portable state carries whatever its plan was (every head then holds the cells' tokens)
        if ((per_head && !grp.per_head) || (grp.per_head && !head_scores)) {
            throw std::runtime_error("PolyKV: the saved state selects per head where this plan selects per layer (or the reverse); "
                                     "a portable state serves both");
        }
        std::vector<uint32_t> used;
        for (uint32_t i = 0; i < cells.size(); ++i) {
            if (!cells.is_empty(i)) {
                used.push_back(i);
            }
        }
        if (head_scores && used.size() != n_cells) {
            throw std::runtime_error("PolyKV: the saved per-head state does not match its cells");
        }
        if (grp.per_head) {
            std::fill(grp.hpos.begin(), grp.hpos.end(), -1);
            for (uint32_t h = 0; h < grp.n_head_kv; ++h) {
                for (uint32_t c : used) {
                    grp.hpos[(size_t) h*grp.capacity + c] = cells.pos_get(c);
                }
            }
        }
        if (head_scores) {
            std::vector<float> skip(3 + n_ring);
            for (uint32_t h = 0; h < grp.n_head_kv; ++h) {
                for (uint32_t c : used) {
                    if (per_head) {
                        io.read(&grp.hpos[(size_t) h*grp.capacity + c], sizeof(llama_pos));
                    }
                    if (!grp.head_scores()) {
                        io.read(skip.data(), skip.size() * sizeof(float));
                        continue;
                    }
                    const size_t off = grp.head_off(h);
                    io.read(&grp.acc[off + c],   sizeof(float));
                    io.read(&grp.last[off + c],  sizeof(float));
                    io.read(&grp.knorm[off + c], sizeof(float));
                    for (auto & row : grp.ring) {
                        io.read(&row[off + c], sizeof(float));
                    }
                }
            }
        }
    }
}

void llama_kv_cache_poly::on_placed(uint32_t g, const std::vector<uint32_t> & cells, const llama_ubatch & ubatch) {
    auto & grp = groups[g];
    grp.new_cells = cells;
    for (uint32_t k = 0; k < grp.n_slots(); ++k) {
        const size_t off = (size_t) k * grp.capacity;
        for (uint32_t c : cells) {
            grp.acc[off + c]   = 0.0f;
            grp.last[off + c]  = 0.0f;
            grp.knorm[off + c] = 0.0f;
            for (auto & row : grp.ring) {
                row[off + c] = 0.0f;
            }
        }
    }
    if (grp.per_head) {
        for (uint32_t h = 0; h < grp.n_head_kv; ++h) {
            for (size_t i = 0; i < cells.size(); ++i) {
                grp.hpos[(size_t) h*grp.capacity + cells[i]] = ubatch.pos[i];
            }
        }
    }
}

static int32_t ring_size(const llama_kv_cache_poly::group & grp) {
    int32_t w = grp.collect_all ? POLYKV_PORTABLE_OBS_WINDOW : 0;
    for (int p = 0; p < 2; ++p) {
        if (grp.phase[p].pattern == LLAMA_POLYKV_SNAPKV || grp.phase[p].pattern == LLAMA_POLYKV_PYRAMIDKV) {
            w = std::max(w, grp.phase[p].obs_window);
        }
    }
    return w;
}

// add the attention rows of one graph output to the score state: t is [nh, n_kv, n_rows] (rows[(r*n_kv + j)*nh + h]:
// attention of query row r to cell j, averaged over the query heads of the layer (nh = 1) or of KV head h), and
// head h's state lives at off(h)
template <typename F>
static void add_rows(llama_kv_cache_poly::group & grp, ggml_tensor * t, int32_t w, F off) {
    const int64_t nh = t->ne[0];
    const int64_t n_kv = t->ne[1];
    const int64_t n_rows = t->ne[2];
    std::vector<float> rows(nh * n_kv * n_rows);
    ggml_backend_tensor_get(t, rows.data(), 0, rows.size() * sizeof(float));
    auto at = [&](int64_t r, int64_t j, int64_t h) { return rows[(r*n_kv + j)*nh + h]; };

    if (grp.needs(LLAMA_POLYKV_H2O)) {
        for (int64_t h = 0; h < nh; ++h) {
            float * acc = grp.acc.data() + off(h);
            for (int64_t r = 0; r < n_rows; ++r) {
                for (int64_t j = 0; j < n_kv; ++j) {
                    acc[j] += at(r, j, h);
                }
            }
        }
    }
    if (grp.needs(LLAMA_POLYKV_TOVA)) {
        for (int64_t h = 0; h < nh; ++h) {
            float * last = grp.last.data() + off(h);
            std::fill(last, last + grp.capacity, 0.0f);
            for (int64_t j = 0; j < n_kv; ++j) {
                last[j] = at(n_rows - 1, j, h);
            }
        }
    }
    if (w > 0) {
        // the ring's rows are shared by the slots: the newest rows go to the end, the layer's and the heads' alike
        const int64_t r0 = std::max<int64_t>(0, n_rows - w);
        const size_t n_ring = grp.ring.size();
        for (int64_t r = r0; r < n_rows; ++r) {
            float * row = grp.ring[n_ring - (n_rows - r)].data();
            for (int64_t h = 0; h < nh; ++h) {
                for (int64_t j = 0; j < n_kv; ++j) {
                    row[off(h) + j] = at(r, j, h);
                }
            }
        }
    }
}

void llama_kv_cache_poly::read_scores(group & grp, uint32_t n_tokens) {
    const size_t cap = grp.capacity;
    if (grp.t_rows || grp.t_rows_heads) {
        const int32_t w = ring_size(grp);
        if (w > 0) {
            // push one zeroed row per new query row (as many as the graph kept), drop the oldest beyond w
            const int64_t n_rows = (grp.t_rows ? grp.t_rows : grp.t_rows_heads)->ne[2];
            for (int64_t r = std::max<int64_t>(0, n_rows - w); r < n_rows; ++r) {
                grp.ring.emplace_back((size_t) grp.n_slots() * cap, 0.0f);
            }
            while ((int32_t) grp.ring.size() > w) {
                grp.ring.erase(grp.ring.begin());
            }
        }
        if (grp.t_rows) {
            add_rows(grp, grp.t_rows, w, [](int64_t) { return (size_t) 0; });
        }
        if (grp.t_rows_heads) {
            add_rows(grp, grp.t_rows_heads, w, [&](int64_t h) { return grp.head_off((uint32_t) h); });
        }
    }
    if (grp.t_knorm) {
        const int64_t n_head_kv = grp.t_knorm->ne[1];
        GGML_ASSERT(grp.t_knorm->ne[2] == (int64_t) n_tokens && grp.new_cells.size() == n_tokens);
        std::vector<float> norms(n_head_kv * n_tokens);
        ggml_backend_tensor_get(grp.t_knorm, norms.data(), 0, norms.size() * sizeof(float));
        for (uint32_t t = 0; t < n_tokens; ++t) {
            const uint32_t c = grp.new_cells[t];
            if (grp.head_scores()) {
                for (int64_t h = 0; h < n_head_kv; ++h) {
                    grp.knorm[grp.head_off((uint32_t) h) + c] = (float) std::sqrt((double) norms[t*n_head_kv + h]);
                }
            }
            if (grp.layer_scores()) {
                double s = 0.0;
                for (int64_t h = 0; h < n_head_kv; ++h) {
                    s += std::sqrt((double) norms[t*n_head_kv + h]);
                }
                grp.knorm[c] = (float) (s / n_head_kv);
            }
        }
    }
    grp.t_rows  = nullptr;
    grp.t_rows_heads = nullptr;
    grp.t_knorm = nullptr;
}

// as polykv_cpp.patterns._protect: +inf on the last min(window, budget) and the first min(n_sink, budget - w)
static void protect(std::vector<double> & sc, int32_t budget, int32_t n_sink, int32_t window) {
    const int32_t n = sc.size();
    const int32_t w = std::min({ window, budget, n });
    const int32_t s = std::min({ n_sink, budget - w, n - w });
    for (int32_t i = n - w; i < n; ++i) {
        sc[i] = INFINITY;
    }
    for (int32_t i = 0; i < s; ++i) {
        sc[i] = INFINITY;
    }
}

// the cells to drop from one token set: items are (pos, cell) sorted by position, off the state offset of the set
// (h*capacity for head h of a per-head group, 0 for a layer); keeps the pattern's budget, as the reference
static std::vector<uint32_t> select_drop(const llama_kv_cache_poly::group & grp, const llama_polykv_phase_plan & pp,
                                         const std::vector<std::pair<llama_pos, uint32_t>> & items, size_t off) {
    const int32_t n = items.size();
    const int32_t b = pp.budget;
    std::vector<uint32_t> drop;
    if (n <= b) {
        return drop;
    }
    std::vector<double> sc(n, 0.0);
    switch (pp.pattern) {
        case LLAMA_POLYKV_STREAMINGLLM:
            {
                const int32_t s = std::min(pp.n_sink, b - 1);
                for (int32_t i = 0; i < n; ++i) {
                    sc[i] = i < s ? INFINITY : (double) i;
                }
            } break;
        case LLAMA_POLYKV_H2O:
            {
                for (int32_t i = 0; i < n; ++i) {
                    sc[i] = grp.acc[off + items[i].second];
                }
                protect(sc, b, pp.n_sink, pp.window);
            } break;
        case LLAMA_POLYKV_TOVA:
            {
                for (int32_t i = 0; i < n; ++i) {
                    sc[i] = grp.last[off + items[i].second];
                }
                protect(sc, b, pp.n_sink, pp.window);
            } break;
        case LLAMA_POLYKV_SNAPKV:
        case LLAMA_POLYKV_PYRAMIDKV:
            {
                std::vector<double> raw(n, 0.0);
                const size_t w = std::min<size_t>(grp.ring.size(), pp.obs_window);
                for (size_t r = grp.ring.size() - w; r < grp.ring.size(); ++r) {
                    for (int32_t i = 0; i < n; ++i) {
                        raw[i] += grp.ring[r][off + items[i].second];
                    }
                }
                const int32_t h = pp.pool_kernel / 2;
                for (int32_t i = 0; i < n; ++i) {
                    double m = -INFINITY;
                    for (int32_t k = std::max(0, i - h); k <= std::min(n - 1, i + h); ++k) {
                        m = std::max(m, raw[k]);
                    }
                    sc[i] = m;
                }
                protect(sc, b, pp.n_sink, std::max(pp.window, pp.obs_window));
            } break;
        case LLAMA_POLYKV_KNORM:
            {
                for (int32_t i = 0; i < n; ++i) {
                    sc[i] = -grp.knorm[off + items[i].second];
                }
                protect(sc, b, pp.n_sink, pp.window);
            } break;
        case LLAMA_POLYKV_FULLKV:
            return drop;
    }

    // keep the b highest scores; among ties the more recent token (stable ascending sort, keep the tail)
    std::vector<int32_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t c) { return sc[a] < sc[c]; });
    for (int32_t k = 0; k < n - b; ++k) {
        drop.push_back(items[order[k]].second);
    }
    return drop;
}

void llama_kv_cache_poly::evict(group & grp, const llama_polykv_phase_plan & pp) {
    if (pp.pattern == LLAMA_POLYKV_FULLKV || pp.budget < 0) {
        return; // a FullKV sliding-window group behaves exactly as the stock SWA cache (it recycles masked cells)
    }
    if (grp.per_head) {
        const size_t cap = grp.capacity;
        // sliding window: what the next query cannot see any more leaves every head first (as below)
        llama_pos p_out = -1;
        if (grp.is_swa) {
            llama_pos pos_max = -1;
            for (llama_pos p : grp.hpos) {
                pos_max = std::max(pos_max, p);
            }
            p_out = pos_max + 2 - (llama_pos) hparams.n_swa;
        }
        uint64_t n_drop = 0;
        for (uint32_t h = 0; h < grp.n_head_kv; ++h) {
            std::vector<std::pair<llama_pos, uint32_t>> items;
            for (uint32_t c = 0; c < cap; ++c) {
                llama_pos & p = grp.hpos[h*cap + c];
                if (p >= 0 && p < p_out) {
                    p = -1;
                }
                if (p >= 0) {
                    items.emplace_back(p, c);
                }
            }
            std::sort(items.begin(), items.end());
            for (uint32_t c : select_drop(grp, pp, items, grp.head_off(h))) {
                grp.hpos[h*cap + c] = -1;
                ++n_drop;
            }
        }
        grp.n_evicted += n_drop / grp.n_head_kv;
        repack(grp);
        return;
    }
    if (grp.is_swa) {
        // the budget counts visible tokens: those that left the window are masked for every later query (the
        // next one is at pos_max + 1 and sees p > pos_max + 1 - n_swa), so free their cells first
        const llama_pos pos_max = grp.kv->seq_pos_max(0);
        const llama_pos p_out   = pos_max + 2 - (llama_pos) hparams.n_swa;
        if (p_out > 0 && grp.kv->seq_pos_min(0) < p_out) {
            grp.kv->seq_rm(0, 0, p_out);
        }
    }
    const auto & cells = grp.kv->get_cells(0);
    std::vector<std::pair<llama_pos, uint32_t>> items; // (pos, cell), oldest first
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (!cells.is_empty(i)) {
            items.emplace_back(cells.pos_get(i), i);
        }
    }
    std::sort(items.begin(), items.end());
    std::vector<llama_pos> drop;
    for (uint32_t c : select_drop(grp, pp, items, 0)) {
        drop.push_back(cells.pos_get(c));
    }
    for (llama_pos p : drop) {
        grp.kv->seq_rm(0, p, p + 1);
    }
    grp.n_evicted += drop.size();
}

// the V storage tensor of a layer (the cache exposes it only through views)
static ggml_tensor * v_storage(const llama_kv_cache & kv, int32_t il) {
    ggml_init_params ip = { 4*ggml_tensor_overhead(), nullptr, /*no_alloc*/ true };
    ggml_context * ctx = ggml_init(ip);
    llama_kv_cache::slot_info sinfo;
    sinfo.s0 = 0;
    sinfo.s1 = 0;
    sinfo.strm = { 0 };
    sinfo.idxs = { {} };
    ggml_tensor * view = kv.get_v(ctx, il, 1, sinfo);
    ggml_tensor * v = view->view_src ? view->view_src : view;
    ggml_free(ctx);
    return v;
}

void llama_kv_cache_poly::repack(group & grp) {
    const uint32_t cap = grp.capacity;
    const uint32_t nh  = grp.n_head_kv;

    uint32_t n_rows = 0; // cells the largest head needs
    std::vector<uint32_t> count(nh, 0);
    for (uint32_t h = 0; h < nh; ++h) {
        for (uint32_t c = 0; c < cap; ++c) {
            count[h] += grp.hpos[h*cap + c] >= 0;
        }
        n_rows = std::max(n_rows, count[h]);
    }

    // each head fills its holes below n_rows with its tokens from above n_rows
    struct move { uint32_t h, src, dst; };
    std::vector<move> moves;
    uint32_t hi = 0;
    for (uint32_t h = 0; h < nh; ++h) {
        uint32_t dst = 0;
        for (uint32_t src = n_rows; src < cap; ++src) {
            if (grp.hpos[h*cap + src] < 0) {
                continue;
            }
            while (grp.hpos[h*cap + dst] >= 0) {
                ++dst;
            }
            GGML_ASSERT(dst < n_rows);
            moves.push_back({ h, src, dst });
            hi = std::max(hi, src + 1);
            ++dst;
        }
    }

    if (!moves.empty()) {
        for (int32_t il : grp.layers) {
            // K (and V without v_trans): one row per cell, head h at h*head_bytes within it
            ggml_tensor * k = grp.kv->get_k_storage(il);
            ggml_tensor * v = v_storage(*grp.kv, il);
            for (ggml_tensor * t : { k, v }) {
                const bool is_v = t == v;
                const uint32_t d = is_v ? hparams.n_embd_head_v(il) : hparams.n_embd_head_k(il);
                if (is_v && v_trans) {
                    // V transposed: element (cell c, feature j) at c + cap*j; the block of head h is contiguous
                    const size_t es = ggml_type_size(t->type);
                    std::vector<uint8_t> blk((size_t) d * cap * es);
                    for (uint32_t h = 0; h < nh; ++h) {
                        bool any = false;
                        for (const auto & m : moves) {
                            any |= m.h == h;
                        }
                        if (!any) {
                            continue;
                        }
                        const size_t off = (size_t) h * d * cap * es;
                        ggml_backend_tensor_get(t, blk.data(), off, blk.size());
                        for (const auto & m : moves) {
                            if (m.h != h) {
                                continue;
                            }
                            for (uint32_t i = 0; i < d; ++i) {
                                memcpy(&blk[((size_t) i*cap + m.dst)*es], &blk[((size_t) i*cap + m.src)*es], es);
                            }
                        }
                        ggml_backend_tensor_set(t, blk.data(), off, blk.size());
                    }
                    continue;
                }
                const size_t row_bytes  = ggml_row_size(t->type, t->ne[0]);
                const size_t head_bytes = ggml_row_size(t->type, d);
                std::vector<uint8_t> buf((size_t) hi * row_bytes);
                ggml_backend_tensor_get(t, buf.data(), 0, buf.size());
                for (const auto & m : moves) {
                    memcpy(&buf[m.dst*row_bytes + m.h*head_bytes], &buf[m.src*row_bytes + m.h*head_bytes], head_bytes);
                }
                ggml_backend_tensor_set(t, buf.data(), 0, (size_t) n_rows * row_bytes);
            }
        }
        for (const auto & m : moves) {
            const size_t s = grp.head_off(m.h) + m.src;
            const size_t t = grp.head_off(m.h) + m.dst;
            grp.acc[t]   = grp.acc[s];
            grp.last[t]  = grp.last[s];
            grp.knorm[t] = grp.knorm[s];
            for (auto & row : grp.ring) {
                row[t] = row[s];
            }
            grp.hpos[(size_t) m.h*cap + m.dst] = grp.hpos[(size_t) m.h*cap + m.src];
            grp.hpos[(size_t) m.h*cap + m.src] = -1;
        }
    }

    // the stock cell of c carries the newest position any head holds there: it is free only when all heads left
    // it, and a sliding-window cache may recycle it only when every head's token there is out of the window
    // (the mask itself comes from hpos, set_input_kq_mask_heads)
    auto & cells = const_cast<llama_kv_cells &>(grp.kv->get_cells(0));
    for (uint32_t c = 0; c < cap; ++c) {
        llama_pos want = -1;
        for (uint32_t h = 0; h < nh; ++h) {
            want = std::max(want, grp.hpos[h*cap + c]);
        }
        const llama_pos have = cells.is_empty(c) ? -1 : cells.pos_get(c);
        if (want == have) {
            continue;
        }
        if (have >= 0) {
            cells.rm(c);
        }
        if (want >= 0) {
            cells.pos_set(c, want);
            cells.seq_add(c, 0);
        }
    }
}

llama_polykv_phase_plan llama_kv_cache_poly::streaming_phase(const llama_polykv_phase_plan & pp) const {
    llama_polykv_phase_plan res = pp;
    if (prefill_slack > 1.0f && pp.pattern != LLAMA_POLYKV_FULLKV && pp.budget >= 0) {
        res.budget = (int32_t) std::min<double>(n_ctx, std::ceil((double) pp.budget * prefill_slack));
    }
    return res;
}

void llama_kv_cache_poly::before_ubatch(const llama_ubatch & ubatch) {
    if (prompt_pending && ubatch.n_tokens == 1) {
        compress_prompt();
    }
}

uint64_t llama_kv_cache_poly::compress_prompt() {
    uint64_t n_freed = 0;
    for (auto & grp : groups) {
        const uint64_t n0 = grp.n_evicted;
        evict(grp, grp.phase[LLAMA_POLYKV_PHASE_PREFILL]);
        n_freed += grp.n_evicted - n0;
        if (prefill_exact && grp.n_evicted > n0 && !grp.per_head) { // per-head eviction repacks by itself
            compact(grp);
        }
    }
    prompt_pending = false;
    return n_freed;
}

namespace {

// in-memory llama_io for moving one group's cells through the stock cache's own state format
class polykv_io_write : public llama_io_write_i {
public:
    void write(const void * src, size_t size) override {
        const uint8_t * p = (const uint8_t *) src;
        buf.insert(buf.end(), p, p + size);
    }
    void write_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        const size_t n0 = buf.size();
        buf.resize(n0 + size);
        ggml_backend_tensor_get(tensor, buf.data() + n0, offset, size);
    }
    size_t n_bytes() override { return buf.size(); }

    std::vector<uint8_t> buf;
};

class polykv_io_read : public llama_io_read_i {
public:
    explicit polykv_io_read(const std::vector<uint8_t> & buf) : buf(buf) {}
    void read(void * dst, size_t size) override {
        check(size);
        memcpy(dst, buf.data() + pos, size);
        pos += size;
    }
    void read_tensor(ggml_tensor * tensor, size_t offset, size_t size) override {
        check(size);
        ggml_backend_tensor_set(tensor, buf.data() + pos, offset, size);
        pos += size;
    }
    size_t n_bytes() override { return pos; }

private:
    void check(size_t size) const {
        if (pos + size > buf.size()) {
            throw std::runtime_error("PolyKV: compaction read past its buffer");
        }
    }
    const std::vector<uint8_t> & buf;
    size_t pos = 0;
};

} // namespace

void llama_kv_cache_poly::compact(group & grp) {
    struct cell_score {
        float acc, last, knorm;
        std::vector<float> ring;
    };
    std::map<llama_pos, cell_score> by_pos;
    {
        const auto & cells = grp.kv->get_cells(0);
        for (uint32_t i = 0; i < cells.size(); ++i) {
            if (cells.is_empty(i)) {
                continue;
            }
            cell_score cs = { grp.acc[i], grp.last[i], grp.knorm[i], {} };
            for (const auto & row : grp.ring) {
                cs.ring.push_back(row[i]);
            }
            by_pos[cells.pos_get(i)] = std::move(cs);
        }
    }
    // a whole-cache restore of the stock cache puts the cells it reads at cells 0..n-1
    polykv_io_write w;
    grp.kv->state_write(w);
    polykv_io_read r(w.buf);
    grp.kv->state_read(r);

    std::fill(grp.acc.begin(), grp.acc.end(), 0.0f);
    std::fill(grp.last.begin(), grp.last.end(), 0.0f);
    std::fill(grp.knorm.begin(), grp.knorm.end(), 0.0f);
    for (auto & row : grp.ring) {
        std::fill(row.begin(), row.end(), 0.0f);
    }
    const auto & cells = grp.kv->get_cells(0);
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (cells.is_empty(i)) {
            continue;
        }
        const auto it = by_pos.find(cells.pos_get(i));
        GGML_ASSERT(it != by_pos.end());
        grp.acc[i]   = it->second.acc;
        grp.last[i]  = it->second.last;
        grp.knorm[i] = it->second.knorm;
        for (size_t k = 0; k < grp.ring.size(); ++k) {
            grp.ring[k][i] = it->second.ring[k];
        }
    }
}

void llama_kv_cache_poly::after_ubatch(llama_context * lctx, const llama_ubatch & ubatch) {
    bool any_scores = false;
    for (const auto & grp : groups) {
        any_scores |= grp.t_rows != nullptr || grp.t_rows_heads != nullptr || grp.t_knorm != nullptr;
    }
    if (any_scores || prefill_exact) {
        // wait for the scores (and, in exact modes, for the cache writes a compaction may read before the next
        // ubatch); not llama_synchronize(), which would book the whole batch's timing now
        ggml_backend_sched_synchronize(lctx->get_sched());
    }
    const bool decode = ubatch.n_tokens == 1;
    const int phase = decode ? LLAMA_POLYKV_PHASE_DECODE : LLAMA_POLYKV_PHASE_PREFILL;
    for (auto & grp : groups) {
        read_scores(grp, ubatch.n_tokens);
        if (decode) {
            evict(grp, grp.phase[phase]);
        } else if (!prefill_exact) {
            evict(grp, streaming_phase(grp.phase[phase]));
        }
    }
    prompt_pending = compresses_at_decode() && !decode;
}

std::vector<llama_pos> llama_kv_cache_poly::kept_positions(int32_t il, int32_t head) const {
    std::vector<llama_pos> res;
    if (il < 0 || il >= (int32_t) layer_group.size() || layer_group[il] < 0) {
        return res;
    }
    const auto & grp = groups[layer_group[il]];
    if (grp.per_head) {
        for (uint32_t h = 0; h < grp.n_head_kv; ++h) {
            if (head >= 0 && (uint32_t) head != h) {
                continue;
            }
            for (uint32_t c = 0; c < grp.capacity; ++c) {
                if (grp.hpos[h*grp.capacity + c] >= 0) {
                    res.push_back(grp.hpos[h*grp.capacity + c]);
                }
            }
        }
        std::sort(res.begin(), res.end());
        res.erase(std::unique(res.begin(), res.end()), res.end());
        return res;
    }
    const auto & cells = grp.kv->get_cells(0);
    for (uint32_t i = 0; i < cells.size(); ++i) {
        if (!cells.is_empty(i)) {
            res.push_back(cells.pos_get(i));
        }
    }
    std::sort(res.begin(), res.end());
    return res;
}

void llama_kv_cache_poly::set_input_kq_mask_heads(uint32_t g, ggml_tensor * dst, const llama_ubatch * ubatch, uint32_t n_head) const {
    const auto & grp = groups[g];
    GGML_ASSERT(grp.per_head && ggml_backend_buffer_is_host(dst->buffer));
    const int64_t n_kv = dst->ne[0];
    const int64_t n_tokens = dst->ne[1];
    GGML_ASSERT(dst->ne[2] == (int64_t) n_head && n_head % grp.n_head_kv == 0 && n_tokens == (int64_t) ubatch->n_tokens);
    const uint32_t rk = n_head / grp.n_head_kv;
    const uint32_t cap = grp.capacity;
    const uint32_t n_swa = grp.is_swa ? hparams.n_swa : 0;
    std::vector<float> row(n_kv);
    for (uint32_t h = 0; h < grp.n_head_kv; ++h) {
        for (int64_t i = 0; i < n_tokens; ++i) {
            const llama_pos p1 = ubatch->pos[i];
            for (int64_t j = 0; j < n_kv; ++j) {
                const llama_pos p0 = j < (int64_t) cap ? grp.hpos[h*cap + j] : -1;
                const bool visible = p0 >= 0 && p0 <= p1 && (n_swa == 0 || p1 - p0 < (llama_pos) n_swa);
                row[j] = visible ? 0.0f : -INFINITY;
            }
            for (uint32_t q = h*rk; q < (h + 1)*rk; ++q) {
                char * out = (char *) dst->data + i*dst->nb[1] + q*dst->nb[2];
                if (dst->type == GGML_TYPE_F16) {
                    ggml_fp16_t * o = (ggml_fp16_t *) out;
                    for (int64_t j = 0; j < n_kv; ++j) {
                        o[j] = ggml_fp32_to_fp16(row[j]);
                    }
                } else {
                    memcpy(out, row.data(), n_kv * sizeof(float));
                }
            }
        }
    }
}

//
// llama_kv_cache_poly_context
//

llama_kv_cache_poly_context::llama_kv_cache_poly_context(llama_memory_status status) : status(status) {}

llama_kv_cache_poly_context::llama_kv_cache_poly_context(llama_kv_cache_poly * kv) : status(LLAMA_MEMORY_STATUS_SUCCESS), kv(kv) {
    for (uint32_t g = 0; g < kv->n_groups(); ++g) {
        group_ctxs.push_back(kv->get_group(g).kv->init_full());
    }
}

llama_kv_cache_poly_context::llama_kv_cache_poly_context(llama_kv_cache_poly * kv, std::vector<llama_ubatch> ubatches) :
    status(LLAMA_MEMORY_STATUS_SUCCESS), kv(kv), ubatches(std::move(ubatches)) {
}

bool llama_kv_cache_poly_context::next() {
    assert(status == LLAMA_MEMORY_STATUS_SUCCESS);
    return ++i_cur < ubatches.size();
}

bool llama_kv_cache_poly_context::apply() {
    assert(!llama_memory_status_is_fail(status));
    if (ubatches.empty()) {
        return true;
    }
    // lazy slotting: the cells freed by the eviction after the previous ubatch are reused now
    const auto & ubatch = ubatches[i_cur];
    kv->before_ubatch(ubatch);
    group_ctxs.clear();
    for (uint32_t g = 0; g < kv->n_groups(); ++g) {
        auto & grp = kv->get_group(g);
        auto sinfo = grp.kv->find_slot(ubatch, false);
        if (sinfo.empty()) {
            LLAMA_LOG_ERROR("%s: PolyKV group %u (layers %d..%d, %u cells) has no room for %u tokens: the context is full\n",
                    __func__, g, grp.layers.front(), grp.layers.back(), grp.capacity, ubatch.n_tokens);
            return false;
        }
        auto gctx = std::make_unique<llama_kv_cache_context>(grp.kv.get(), llama_kv_cache::slot_info_vec_t{ sinfo },
                                                             std::vector<llama_ubatch>{ ubatch });
        gctx->apply();
        kv->on_placed(g, sinfo.idxs[0], ubatch);
        group_ctxs.push_back(std::move(gctx));
    }
    return true;
}

llama_memory_status llama_kv_cache_poly_context::get_status() const {
    return status;
}

const llama_ubatch & llama_kv_cache_poly_context::get_ubatch() const {
    assert(status == LLAMA_MEMORY_STATUS_SUCCESS);
    return ubatches[i_cur];
}

const llama_kv_cache_context * llama_kv_cache_poly_context::get_group(uint32_t g) const {
    return static_cast<const llama_kv_cache_context *>(group_ctxs[g].get());
}

//
// graph input
//

llm_graph_input_attn_kv_poly::llm_graph_input_attn_kv_poly(
        const llama_hparams & hparams,
        const llama_cparams & cparams,
        const llama_kv_cache_poly_context * pctx) :
    llm_graph_input_attn_kv(hparams, cparams, pctx->get_group(0)), pctx(pctx) {
}

void llm_graph_input_attn_kv_poly::set_input(const llama_ubatch * ubatch) {
    for (size_t g = 0; g < groups.size(); ++g) {
        auto & inp = groups[g];
        if (!head_masks[g]) {
            inp->set_input(ubatch);
            continue;
        }
        // per-head group: the stock idxs and rotations, a mask of our own
        if (inp->self_k_idxs && inp->self_k_idxs->buffer) {
            inp->mctx->set_input_k_idxs(inp->self_k_idxs, ubatch);
        }
        if (inp->self_v_idxs && inp->self_v_idxs->buffer) {
            inp->mctx->set_input_v_idxs(inp->self_v_idxs, ubatch);
        }
        if (head_masks[g]->buffer) {
            pctx->get_poly()->set_input_kq_mask_heads(g, head_masks[g], ubatch, n_head);
        }
        if (inp->self_k_rot && inp->self_k_rot->buffer) {
            inp->mctx->set_input_k_rot(inp->self_k_rot);
        }
        if (inp->self_v_rot && inp->self_v_rot->buffer) {
            inp->mctx->set_input_v_rot(inp->self_v_rot);
        }
    }
}

bool llm_graph_input_attn_kv_poly::can_reuse(const llm_graph_params & params) {
    GGML_UNUSED(params);
    // cell counts change with every eviction
    return false;
}

llm_graph_input_attn_kv * llm_graph_input_attn_kv_poly::group_input(int32_t il) const {
    const int32_t g = pctx->get_poly()->group_of(il);
    GGML_ASSERT(g >= 0);
    return groups[g].get();
}

llm_graph_input_attn_kv_iswa_poly::llm_graph_input_attn_kv_iswa_poly(
        const llama_hparams & hparams,
        const llama_cparams & cparams,
        std::unique_ptr<llm_graph_input_attn_kv_poly> kv) :
    llm_graph_input_attn_kv_iswa(hparams, cparams, nullptr), kv(std::move(kv)) {
}

void llm_graph_input_attn_kv_iswa_poly::set_input(const llama_ubatch * ubatch) {
    kv->set_input(ubatch);
}

bool llm_graph_input_attn_kv_iswa_poly::can_reuse(const llm_graph_params & params) {
    return kv->can_reuse(params);
}

std::unique_ptr<llm_graph_input_attn_kv_poly> llama_polykv_build_input(
        ggml_context * ctx0,
        const llama_ubatch & ubatch,
        const llama_hparams & hparams,
        const llama_cparams & cparams,
        const llama_kv_cache_poly_context * pctx) {
    auto inp = std::make_unique<llm_graph_input_attn_kv_poly>(hparams, cparams, pctx);
    const int64_t n_stream = cparams.kv_unified ? 1 : ubatch.n_seqs_unq;
    for (uint32_t g = 0; g < pctx->n_groups(); ++g) {
        const auto * gctx = pctx->get_group(g);
        auto ginp = std::make_unique<llm_graph_input_attn_kv>(hparams, cparams, gctx);
        ginp->self_k_idxs = gctx->build_input_k_idxs(ctx0, ubatch);
        ginp->self_v_idxs = gctx->build_input_v_idxs(ctx0, ubatch);
        // flash attention wants an f16 mask; a per-head group has one mask per query head (ggml indexes the mask by
        // query head, K and V by KV head)
        const auto & grp = pctx->get_poly()->get_group(g);
        const int64_t n_mask_heads = grp.per_head ? hparams.n_head(grp.layers.front()) : 1;
        ginp->self_kq_mask = ggml_new_tensor_4d(ctx0, cparams.flash_attn ? GGML_TYPE_F16 : GGML_TYPE_F32,
                                                gctx->get_n_kv(), ubatch.n_tokens/n_stream, n_mask_heads, n_stream);
        inp->head_masks.push_back(grp.per_head ? ginp->self_kq_mask : nullptr);
        if (grp.per_head) {
            GGML_ASSERT(n_stream == 1);
            inp->n_head = (uint32_t) n_mask_heads;
        }
        ggml_set_input(ginp->self_kq_mask);
        ggml_set_name(ginp->self_kq_mask, "attn_inp_kq_mask");
        ginp->self_kq_mask_cnv = ginp->self_kq_mask;
        ginp->self_k_rot = gctx->build_input_k_rot(ctx0);
        ginp->self_v_rot = gctx->build_input_v_rot(ctx0);
        inp->groups.push_back(std::move(ginp));
    }
    return inp;
}

//
// hooks
//

static bool arch_supported(llm_arch arch) {
    switch (arch) {
        case LLM_ARCH_LLAMA:
        case LLM_ARCH_QWEN2:
        case LLM_ARCH_QWEN3:
        case LLM_ARCH_GEMMA3:
            return true;
        default:
            return false;
    }
}

llama_memory_i * llama_polykv_create_memory(const llama_model & model, const llama_memory_params & params, const llama_cparams & cparams) {
    int32_t kv_budget = 0;
    std::string source;
    const std::string text = find_plan(model, kv_budget, source);
    if (text.empty()) {
        return nullptr;
    }
    llama_polykv_plan plan;
    std::string err;
    if (!llama_polykv_plan_parse(text, plan, err)) {
        throw std::runtime_error("PolyKV: invalid plan (" + source + "): " + err);
    }
    const auto & hparams = model.hparams;
    if (plan.n_layer != (int32_t) hparams.n_layer()) {
        throw std::runtime_error("PolyKV: the plan is for " + std::to_string(plan.n_layer) + " layers but the model has " +
                                 std::to_string(hparams.n_layer()));
    }
    if (!arch_supported(model.arch)) {
        throw std::runtime_error(std::string("PolyKV: architecture '") + llm_arch_name(model.arch) +
                                 "' is not supported yet (supported: llama, qwen2, qwen3, gemma3); run without a plan (LLAMA_POLYKV_DISABLE=1)");
    }
    if ((hparams.swa_type != LLAMA_SWA_TYPE_NONE && hparams.swa_type != LLAMA_SWA_TYPE_STANDARD) || hparams.n_pos_per_embd() != 1) {
        throw std::runtime_error("PolyKV: chunked/symmetric sliding-window and multi-position (M-RoPE) models are not supported yet");
    }
    if (cparams.n_seq_max > 1) {
        throw std::runtime_error("PolyKV: a context with a plan serves one sequence (n_seq_max = 1); got n_seq_max = " +
                                 std::to_string(cparams.n_seq_max));
    }
    std::vector<int32_t> caps(hparams.n_layer(), 0);
    for (uint32_t il = 0; il < hparams.n_layer(); ++il) {
        caps[il] = llama_polykv_model_layer_window(&model, (int32_t) il);
    }
    if (!llama_polykv_plan_resolve(plan, kv_budget, cparams.n_ctx_seq, caps, err)) {
        throw std::runtime_error("PolyKV: " + err);
    }
    int32_t prefill_mode = 0;
    float prefill_slack = 1.0f;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        auto it = g_prefill_mode.find(&model);
        if (it != g_prefill_mode.end()) {
            prefill_mode = it->second;
        } else if (const char * env = getenv("LLAMA_POLYKV_PREFILL")) {
            const std::string v = env;
            prefill_mode = v == "exact" ? 1 : v == "portable" ? 2 : 0;
        }
        auto its = g_prefill_slack.find(&model);
        if (its != g_prefill_slack.end()) {
            prefill_slack = its->second;
        } else if (const char * env = getenv("LLAMA_POLYKV_PREFILL_SLACK")) {
            prefill_slack = (float) atof(env);
            if (!(prefill_slack >= 1.0f)) {
                throw std::runtime_error(std::string("PolyKV: LLAMA_POLYKV_PREFILL_SLACK must be a number >= 1, got ") + env);
            }
        }
    }
    auto * mem = new llama_kv_cache_poly(model, hparams, plan, prefill_mode, prefill_slack, params.type_k, params.type_v, !cparams.flash_attn,
                                         cparams.offload_kqv, cparams.n_ctx_seq, cparams.n_ubatch);
    uint64_t cells = 0;
    uint64_t bytes = 0;
    for (uint32_t g = 0; g < mem->n_groups(); ++g) {
        cells += (uint64_t) mem->get_group(g).capacity * mem->get_group(g).layers.size();
        bytes += mem->group_bytes(g);
    }
    const uint64_t full_cells = (uint64_t) cparams.n_ctx_seq * hparams.n_layer();
    char slack_note[64] = "";
    if (prefill_mode == 0 && prefill_slack > 1.0f) {
        snprintf(slack_note, sizeof(slack_note), ", prefill slack %g", prefill_slack);
    }
    LLAMA_LOG_INFO("%s: PolyKV plan active (%s%s%s%s): %u layers in %u cache groups, %" PRIu64 " cells (FullKV: %" PRIu64 "), KV %.2f MiB = %.1f%% of FullKV\n",
            __func__, source.c_str(), kv_budget > 0 ? (", kv-budget " + std::to_string(kv_budget)).c_str() : "",
            prefill_mode == 1 ? ", exact prefill" : prefill_mode == 2 ? ", exact portable prefill" : "", slack_note,
            hparams.n_layer(), mem->n_groups(), cells, full_cells, bytes / 1024.0 / 1024.0, 100.0 * cells / std::max<uint64_t>(full_cells, 1));
    return mem;
}

void llama_polykv_build_scores(
        ggml_context * ctx0,
         ggml_cgraph * gf,
        const llm_graph_input_attn_kv_poly * inp,
         ggml_tensor * q,
         ggml_tensor * k,
         ggml_tensor * k_cur,
         ggml_tensor * kq_mask,
               float   kq_scale,
             int32_t   il) {
    auto * poly = inp->pctx->get_poly();
    auto & grp = poly->get_group(poly->group_of(il));
    const bool record = inp->pctx->is_batch();
    const int64_t n_tokens = q->ne[2];

    if (grp.needs(LLAMA_POLYKV_KNORM)) {
        ggml_tensor * kc = ggml_cont(ctx0, k_cur);                              // [d, n_head_kv, n_tokens]
        ggml_tensor * sq = ggml_sum_rows(ctx0, ggml_sqr(ctx0, kc));             // [1, n_head_kv, n_tokens]
        ggml_set_output(sq);
        ggml_build_forward_expand(gf, sq);
        grp.t_knorm = record ? sq : nullptr;
    }
    if (!grp.needs_scores()) {
        return;
    }

    // which query rows the patterns read: all (H2O), the observation window (SnapKV), the last (TOVA)
    int64_t n_rows = 1;
    if (grp.needs(LLAMA_POLYKV_H2O)) {
        n_rows = n_tokens;
    } else {
        n_rows = std::max<int64_t>(1, ring_size(grp));
    }
    n_rows = std::min(n_rows, n_tokens);

    const int64_t n_head = q->ne[1];
    ggml_tensor * qs = ggml_view_3d(ctx0, q, q->ne[0], q->ne[1], n_rows, q->nb[1], q->nb[2], (n_tokens - n_rows)*q->nb[2]);
    qs = ggml_permute(ctx0, qs, 0, 2, 1, 3);                                   // [d, n_rows, n_head]
    ggml_tensor * ks = ggml_permute(ctx0, k, 0, 2, 1, 3);                       // [d, n_kv, n_head_kv]
    ggml_tensor * kq = ggml_mul_mat(ctx0, ks, qs);                              // [n_kv, n_rows, n_head]
    ggml_prec_set_acc(kq, GGML_PREC_F32);
    ggml_tensor * m = ggml_view_3d(ctx0, kq_mask, kq_mask->ne[0], n_rows, kq_mask->ne[2], kq_mask->nb[1], kq_mask->nb[2],
                                   (n_tokens - n_rows)*kq_mask->nb[1]);
    if (!ggml_is_contiguous(m)) {
        m = ggml_cont(ctx0, m); // a per-head mask: the last rows of every head's slice
    }
    ggml_tensor * p = ggml_soft_max_ext(ctx0, kq, m, kq_scale, 0.0f);           // [n_kv, n_rows, n_head]
    p = ggml_cont(ctx0, ggml_permute(ctx0, p, 1, 2, 0, 3));                     // [n_head, n_kv, n_rows]
    const int64_t n_kv = p->ne[1];
    if (grp.head_scores()) {
        // query head q reads KV head q / (n_head / n_head_kv): average each KV head's query heads
        const int64_t rk = n_head / grp.n_head_kv;
        ggml_tensor * ph = ggml_reshape_2d(ctx0, p, rk, grp.n_head_kv * n_kv * n_rows);
        ph = ggml_sum_rows(ctx0, ph);                                           // [1, n_head_kv*n_kv*n_rows]
        ph = ggml_reshape_3d(ctx0, ph, grp.n_head_kv, n_kv, n_rows);           // [n_head_kv, n_kv, n_rows]
        ph = ggml_scale(ctx0, ph, 1.0f/rk);
        ggml_set_output(ph);
        ggml_build_forward_expand(gf, ph);
        grp.t_rows_heads = record ? ph : nullptr;
    }
    if (grp.layer_scores()) {
        ggml_tensor * pl = ggml_sum_rows(ctx0, p);                              // [1, n_kv, n_rows]
        pl = ggml_scale(ctx0, pl, 1.0f/n_head);                                 // mean over query heads
        ggml_set_output(pl);
        ggml_build_forward_expand(gf, pl);
        grp.t_rows = record ? pl : nullptr;
    }
}

void llama_polykv_after_ubatch(llama_context * lctx, llama_memory_i * mem, const llama_ubatch & ubatch) {
    auto * poly = dynamic_cast<llama_kv_cache_poly *>(mem);
    if (poly) {
        poly->after_ubatch(lctx, ubatch);
    }
}

//
// public C API
//

const char * llama_polykv_version(void) {
    return LLAMA_POLYKV_VERSION;
}

const char * llama_polykv_llama_commit(void) {
    return LLAMA_POLYKV_LLAMA_COMMIT;
}

const char * llama_polykv_last_error(void) {
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_last_error.c_str();
}

int32_t llama_polykv_set_model_plan(struct llama_model * model, const char * plan_json, int32_t kv_budget) {
    if (!model) {
        set_last_error("model is NULL");
        return -1;
    }
    if (plan_json == nullptr) {
        std::lock_guard<std::mutex> lock(g_mutex);
        g_overrides.erase(model);
        return 0;
    }
    if (plan_json[0] != '\0') {
        llama_polykv_plan plan;
        std::string err;
        if (!llama_polykv_plan_parse(plan_json, plan, err)) {
            set_last_error("invalid plan: " + err);
            return -1;
        }
        if (plan.n_layer != (int32_t) model->hparams.n_layer()) {
            set_last_error("the plan is for " + std::to_string(plan.n_layer) + " layers but the model has " +
                           std::to_string(model->hparams.n_layer()));
            return -1;
        }
    }
    if (kv_budget < 0) {
        set_last_error("kv_budget must be >= 0");
        return -1;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    g_overrides[model] = { plan_json, kv_budget };
    return 0;
}

int32_t llama_polykv_model_layer_window(const struct llama_model * model, int32_t il) {
    if (!model || il < 0 || il >= (int32_t) model->hparams.n_layer()) {
        return -1;
    }
    return model->hparams.is_swa(il) ? (int32_t) model->hparams.n_swa : 0;
}

int32_t llama_polykv_set_model_prefill_mode(struct llama_model * model, int32_t mode) {
    if (!model || mode < 0 || mode > 2) {
        set_last_error("prefill mode must be 0 (chunked), 1 (exact) or 2 (exact, portable state)");
        return -1;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    g_prefill_mode[model] = mode;
    return 0;
}

int32_t llama_polykv_set_model_prefill_slack(struct llama_model * model, float slack) {
    if (!model || !(slack >= 1.0f)) {
        set_last_error("prefill slack must be a number >= 1 (1 = plain chunked prefill)");
        return -1;
    }
    std::lock_guard<std::mutex> lock(g_mutex);
    g_prefill_slack[model] = slack;
    return 0;
}

void llama_polykv_forget_model(const llama_model * model) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_overrides.erase(model);
    g_prefill_mode.erase(model);
    g_prefill_slack.erase(model);
}

static llama_kv_cache_poly * get_poly(const struct llama_context * ctx) {
    return ctx ? dynamic_cast<llama_kv_cache_poly *>(llama_get_memory(ctx)) : nullptr;
}

bool llama_polykv_is_active(const struct llama_context * ctx) {
    return get_poly(ctx) != nullptr;
}

int64_t llama_polykv_compress_prompt(struct llama_context * ctx) {
    auto * poly = get_poly(ctx);
    if (!poly) {
        set_last_error("no PolyKV plan is active in this context");
        return -1;
    }
    llama_synchronize(ctx); // a compaction reads the cache the last decode wrote
    return (int64_t) poly->compress_prompt();
}

int32_t llama_polykv_get_layer_stats(const struct llama_context * ctx, struct llama_polykv_layer_stats * out, int32_t n_max) {
    auto * poly = get_poly(ctx);
    if (!poly) {
        return 0;
    }
    int32_t n = 0;
    const int32_t n_layer = poly->get_plan().n_layer;
    for (int32_t il = 0; il < n_layer; ++il) {
        const int32_t g = poly->group_of(il);
        if (g < 0) {
            continue;
        }
        if (n < n_max && out) {
            const auto & grp = poly->get_group(g);
            auto & s = out[n];
            s.layer           = il;
            s.group           = g;
            s.pattern_prefill = grp.phase[0].pattern;
            s.pattern_decode  = grp.phase[1].pattern;
            s.budget_prefill  = grp.phase[0].pattern == LLAMA_POLYKV_FULLKV ? -1 : grp.phase[0].budget;
            s.budget_decode   = grp.phase[1].pattern == LLAMA_POLYKV_FULLKV ? -1 : grp.phase[1].budget;
            s.capacity        = grp.capacity;
            s.used            = grp.kv->get_cells(0).get_used();
            s.n_evicted       = grp.n_evicted;
            s.bytes           = poly->group_bytes(g) / grp.layers.size();
            s.bytes_fullkv    = (uint64_t) ((double) s.bytes / grp.capacity * poly->get_n_ctx());
        }
        n++;
    }
    return n;
}

int32_t llama_polykv_get_kept_positions(const struct llama_context * ctx, int32_t il, llama_pos * out, int32_t n_max) {
    auto * poly = get_poly(ctx);
    if (!poly) {
        return -1;
    }
    const auto pos = poly->kept_positions(il);
    for (int32_t i = 0; i < (int32_t) pos.size() && i < n_max && out; ++i) {
        out[i] = pos[i];
    }
    return (int32_t) pos.size();
}

int32_t llama_polykv_get_kept_positions_head(const struct llama_context * ctx, int32_t il, int32_t head, llama_pos * out, int32_t n_max) {
    auto * poly = get_poly(ctx);
    if (!poly || il < 0 || il >= poly->get_plan().n_layer || poly->group_of(il) < 0 || head < 0 ||
        head >= (int32_t) poly->get_group(poly->group_of(il)).n_head_kv) {
        return -1;
    }
    const auto pos = poly->kept_positions(il, head);
    for (int32_t i = 0; i < (int32_t) pos.size() && i < n_max && out; ++i) {
        out[i] = pos[i];
    }
    return (int32_t) pos.size();
}

int32_t llama_polykv_layer_per_head(const struct llama_context * ctx, int32_t il) {
    auto * poly = get_poly(ctx);
    if (!poly || il < 0 || il >= poly->get_plan().n_layer || poly->group_of(il) < 0) {
        return -1;
    }
    return poly->get_group(poly->group_of(il)).per_head ? 1 : 0;
}

const char * llama_polykv_pattern_str(int32_t pattern) {
    if (pattern < 0 || pattern > LLAMA_POLYKV_KNORM) {
        return "unknown";
    }
    return k_pattern_names[pattern];
}
