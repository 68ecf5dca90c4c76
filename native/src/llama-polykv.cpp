// PolyKV: the per-group cache (llama_kv_cache_poly), its memory context, the hooks called from llama.cpp and the
// public C API; plans in llama-polykv-plan.cpp, selection in llama-polykv-select.cpp, graph in llama-polykv-graph.cpp

#include "llama-polykv.h"

#include "llama-impl.h"
#include "llama-batch.h"
#include "llama-context.h"
#include "llama-cparams.h"
#include "llama-io.h"
#include "llama-model.h"

#include <algorithm>
#include <atomic>
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

// the last error of the calling thread: a caller reads it right after its own failing call, and another thread's
// error never replaces it, nor frees the string it reads
static thread_local std::string g_last_error;

// a message that is valid UTF-8: the JSON parser's "last read" excerpt can end inside a multi-byte character;
// each byte that does not start a complete sequence becomes '?'
static std::string utf8_valid(const std::string & s) {
    std::string out;
    out.reserve(s.size());
    size_t i = 0;
    while (i < s.size()) {
        const unsigned char c = s[i];
        const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
        bool ok = n > 0 && i + n <= s.size();
        for (size_t k = 1; ok && k < n; ++k) {
            ok = ((unsigned char) s[i + k] >> 6) == 0x2;
        }
        if (ok) {
            out.append(s, i, n);
            i += n;
        } else {
            out.push_back('?');
            i += 1;
        }
    }
    return out;
}

static void set_last_error(const std::string & msg) {
    g_last_error = utf8_valid(msg);
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
        char * end = nullptr;
        const long v = strtol(env, &end, 10);
        if (end == env || *end != '\0' || v <= 0 || v > INT32_MAX) {
            throw std::runtime_error(std::string("PolyKV: LLAMA_POLYKV_KV_BUDGET must be a positive integer, got '") + env + "'");
        }
        kv_budget = (int32_t) v;
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
                 uint32_t   n_ubatch,
             llama_seq_id   seq,
                 uint32_t   n_seq_max) : model(model), hparams(hparams), plan(std::move(plan_in)), n_ctx(n_ctx),
                                        n_ubatch(n_ubatch), v_trans(v_trans), offload(offload), type_k(type_k), type_v(type_v),
                                        seq(seq), n_seq_max(n_seq_max),
                                        prefill_exact(prefill_mode != 0), portable(prefill_mode == 2),
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
            // adaptive heads of different lengths share the cache's slots (docs/design.md): the graph views them as
            // one KV head, which a transposed V cannot give, and a portable prefill keeps identity slots for any plan
            groups.back().pooled = per_head && !v_trans && !portable && hparams.n_head_kv(il) <= UINT8_MAX &&
                (lp[0].selection == LLAMA_POLYKV_SELECT_ADAPTIVE || lp[1].selection == LLAMA_POLYKV_SELECT_ADAPTIVE);
            groups.back().n_head_kv = hparams.n_head_kv(il);
            // a scored prefill pattern streams by the plan's stream pattern in chunked prefill (exact modes score
            // the whole prompt at once; positional layers keep what they would keep anyway)
            if (plan.stream >= 0 && !prefill_exact && (lp[0].needs_scores() || lp[0].pattern == LLAMA_POLYKV_KNORM)) {
                groups.back().stream = plan.stream;
                streams = true;
            }
            g_found = (int32_t) groups.size() - 1;
        }
        groups[g_found].layers.push_back(il);
        layer_group[il] = g_found;
    }
    for (auto & grp : groups) {
        grp.plan_budget = { grp.phase[0].budget, grp.phase[1].budget };
    }
    if (plan.allocation_prompt && !prefill_exact && !(prefill_slack > 1.0f)) {
        LLAMA_LOG_WARN("%s: PolyKV: the plan re-splits its budgets per prompt (\"allocation\": \"prompt\"); chunked "
                       "prefill re-splits only what a layer holds when the prompt ends, its budget x the prefill slack, "
                       "and with a slack of 1 keeps the plan's budgets (use exact prefill or a slack > 1)\n", __func__);
    }

    for (size_t g = 0; g < groups.size(); ++g) {
        auto & grp = groups[g];
        // on GPUs, multiples of 256 keep the fast flash-attention kernels usable; the CPU needs no padding
        for (int32_t il : grp.layers) {
            if (offload && ggml_backend_dev_type(model.dev_layer(il)) != GGML_BACKEND_DEVICE_TYPE_CPU) {
                grp.pad = 256;
            }
        }
        grp.capacity = group_cells(grp, prefill_exact);
        grp.capacity_max = grp.capacity;
        if (grp.per_head) {
            const int32_t il = grp.layers.front();
            if (hparams.n_embd_head_k(il) % ggml_blck_size(type_k) != 0 || hparams.n_embd_head_v(il) % ggml_blck_size(type_v) != 0) {
                throw std::runtime_error("PolyKV: layer " + std::to_string(il) + " selects per KV head, which needs a head size that is a "
                                         "multiple of the KV cache type's block size; use f16 or f32 K/V");
            }
        }

        grp.kv = new_group_cache(grp, grp.capacity);
        new_layout();
        const size_t n_state = (size_t) grp.n_slots() * grp.capacity;
        grp.acc.assign(n_state, 0.0f);
        grp.last.assign(n_state, 0.0f);
        grp.knorm.assign(n_state, 0.0f);
        grp.zmax.assign(n_state, 0.0f);
        grp.ea.assign(n_state, 0.0f);
        if (grp.needs(LLAMA_POLYKV_EXPECTED_ATTENTION)) {
            const int32_t il = grp.layers.front();
            const size_t d = hparams.n_embd_head_k(il);
            grp.ea_sum.assign((size_t) hparams.n_head(il) * d, 0.0);
            grp.ea_sq.assign((size_t) hparams.n_head(il) * d * d, 0.0);
        }
        if (grp.per_head) {
            grp.hpos.assign((size_t) grp.n_head_kv * grp.capacity, -1);
            grp.howner.assign(grp.pooled ? grp.hpos.size() : 0, 0);
        }
    }
}

std::unique_ptr<llama_kv_cache> llama_kv_cache_poly::new_group_cache(const group & grp, uint32_t cap) const {
    std::vector<bool> member(hparams.n_layer(), false);
    for (int32_t il : grp.layers) {
        member[il] = true;
    }
    const std::string tag = "_pkv" + std::to_string(&grp - groups.data());
    return std::make_unique<llama_kv_cache>(
            model, hparams, type_k, type_v, v_trans, offload, /*unified*/ true, cap,
            n_seq_max, /*n_pad*/ 1, grp.is_swa ? hparams.n_swa : 0,
            grp.is_swa ? hparams.swa_type : LLAMA_SWA_TYPE_NONE, nullptr,
            [member](int32_t il) { return member[il]; }, nullptr, nullptr, tag.c_str());
}

void llama_kv_cache_poly::new_layout() {
    static std::atomic<uint64_t> next_id{1};
    layout_id = next_id++;
}

std::vector<int64_t> llama_kv_cache_poly::graph_key(bool record) const {
    std::vector<int64_t> key = { (int64_t) layout_id, record ? 1 : 0, kvzip_active ? 1 : 0 };
    for (const auto & grp : groups) {
        const int64_t flags =
            (grp.needs(LLAMA_POLYKV_KNORM) ? 1 : 0) | (grp.needs(LLAMA_POLYKV_KVZIP) ? 2 : 0) |
            (grp.needs(LLAMA_POLYKV_H2O) ? 4 : 0) | (grp.needs_rows() ? 8 : 0) | (grp.rows_idle ? 16 : 0) |
            (grp.layer_scores() ? 32 : 0) | (grp.head_scores() ? 64 : 0) | (grp.ea_sum.empty() ? 0 : 128) |
            (grp.per_head ? 256 : 0);
        key.push_back(flags);
        key.push_back(grp.ring_size());
        key.push_back(grp.n_head_kv);
    }
    return key;
}

uint32_t llama_kv_cache_poly::group_cells(const group & grp, bool whole_prompt) const {
    uint32_t cap = 0;
    for (int p = 0; p < 2; ++p) {
        const auto & pp = grp.phase[p];
        const bool whole = whole_prompt && p == LLAMA_POLYKV_PHASE_PREFILL;
        uint32_t keep = (pp.pattern == LLAMA_POLYKV_FULLKV || pp.budget < 0 || whole) ? n_ctx : (uint32_t) pp.budget;
        if (p == LLAMA_POLYKV_PHASE_PREFILL && keep < n_ctx) {
            keep = (uint32_t) streaming_phase(pp).budget;
        }
        if (pp.selection == LLAMA_POLYKV_SELECT_ADAPTIVE && grp.per_head && !grp.pooled && keep < n_ctx) {
            keep = (uint32_t) llama_polykv_adaptive_cap((int32_t) keep, (int32_t) grp.n_head_kv); // the longest head
        }
        if (grp.is_swa) {
            keep = std::min(keep, hparams.n_swa);
        }
        // decode: evict_every - 1 tokens more than the budget between evictions, then the next step's tokens
        const uint32_t room = p == LLAMA_POLYKV_PHASE_DECODE ? std::max(n_ubatch, (uint32_t) plan.evict_every) : n_ubatch;
        cap = std::max(cap, keep >= n_ctx ? n_ctx : keep + room);
    }
    return std::min(n_ctx, pad_to(cap, grp.pad));
}

void llama_kv_cache_poly::reset_capacity(group & grp, uint32_t cap) {
    grp.kv = new_group_cache(grp, cap); // allocated before the old one goes: a failure leaves the group as it was
    new_layout();
    grp.capacity = cap;
    if (grp.per_head) {
        grp.hpos.assign((size_t) grp.n_head_kv * cap, -1);
        grp.howner.assign(grp.pooled ? grp.hpos.size() : 0, 0);
    }
    for (auto * v : { &grp.acc, &grp.last, &grp.knorm, &grp.zmax, &grp.ea }) {
        v->assign((size_t) grp.n_slots() * cap, 0.0f);
    }
    grp.clear_ring();
}

uint32_t llama_kv_cache_poly::n_used_cells(const group & grp) const {
    uint32_t n_used = 0;
    const auto & cells = grp.kv->get_cells(0);
    for (uint32_t i = 0; i < cells.size(); ++i) {
        n_used += !cells.is_empty(i);
    }
    return n_used;
}

bool llama_kv_cache_poly::make_room(group & grp, uint32_t n_tokens) {
    const uint32_t n_used = n_used_cells(grp);
    if (keeps_followups()) {
        // kept follow-ups grow the group by what comes, one ubatch of room at a time, up to n_ctx
        const uint32_t cap = std::min(n_ctx, pad_to(n_used + n_tokens + n_ubatch, grp.pad));
        if (n_used + n_tokens > cap || cap <= grp.capacity) {
            return false;
        }
        resize(grp, cap);
        return true;
    }
    if (!prefill_exact || grp.capacity >= grp.capacity_max) {
        return false;
    }
    if (n_used + n_tokens > grp.capacity_max) {
        return false;
    }
    resize(grp, grp.capacity_max); // the prompt that comes is kept whole until its compression
    return true;
}

llama_memory_context_ptr llama_kv_cache_poly::init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all) {
    GGML_UNUSED(embd_all);

    balloc.split_reset();

    std::vector<llama_ubatch> ubatches;
    feed_state fs = feed;
    while (true) {
        auto ubatch = balloc.split_simple(std::min(n_ubatch, ubatch_room(fs)));
        if (ubatch.n_tokens == 0) {
            break;
        }
        fs = feed_after(fs, ubatch);
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
        if (grp.capacity != grp.capacity_max) {
            reset_capacity(grp, grp.capacity_max); // the next prompt is kept whole (exact modes)
        }
        grp.kv->clear(data);
        std::fill(grp.acc.begin(), grp.acc.end(), 0.0f);
        std::fill(grp.last.begin(), grp.last.end(), 0.0f);
        std::fill(grp.knorm.begin(), grp.knorm.end(), 0.0f);
        std::fill(grp.zmax.begin(), grp.zmax.end(), 0.0f);
        std::fill(grp.ea.begin(), grp.ea.end(), 0.0f);
        std::fill(grp.ea_sum.begin(), grp.ea_sum.end(), 0.0);
        std::fill(grp.ea_sq.begin(), grp.ea_sq.end(), 0.0);
        grp.ea_n = 0.0;
        std::fill(grp.hpos.begin(), grp.hpos.end(), -1);
        grp.clear_ring();
    }
    restore_plan_budgets();
    kvzip_scored = false;
    prompt_done = false;
    pos_next = 0;
    feed = feed_state();
}

llama_kv_cache_poly::feed_state llama_kv_cache_poly::feed_after(feed_state fs, const llama_ubatch & ubatch) const {
    const bool output = ubatch.output[ubatch.n_tokens - 1] != 0;
    if (!chunks_aligned() || is_decode(ubatch, fs)) {
        fs.n_open = 0;
    } else {
        fs.n_open += ubatch.n_tokens;
        fs.n_open = fs.n_open >= n_ubatch || output ? 0 : fs.n_open;
    }
    fs.prev_output = output;
    return fs;
}

bool llama_kv_cache_poly::shares_ubatch(bool output, const feed_state & fs) const {
    return !kvzip_active && !probe_active && is_decode_token(output, fs);
}

bool llama_kv_cache_poly::seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1) {
    bool res = true;
    if (p1 < 0 || p1 >= pos_next) {
        // the tail is gone: the sequence ends at p0, and the open chunk (its last n_open tokens) with it
        const llama_pos end = std::min(pos_next, std::max<llama_pos>(p0, 0));
        feed.n_open = (uint32_t) std::max<llama_pos>(0, (llama_pos) feed.n_open - (pos_next - end));
        pos_next = end;
        if (pos_next == 0) {
            feed = feed_state();
        }
        prompt_done = prompt_done && pos_next > 0; // an empty sequence starts a new prompt
    }
    for (auto & grp : groups) {
        if (grp.per_head && (seq_id < 0 || seq_id == seq)) {
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
    llama_pos res = (seq_id < 0 || seq_id == seq) ? pos_next - 1 : -1;
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

void llama_kv_cache_poly::set_rope(const llama_model & mdl, const llama_cparams & cparams) {
    for (auto & grp : groups) {
        if (!grp.needs(LLAMA_POLYKV_EXPECTED_ATTENTION) || (grp.collect_all && hparams.rope_type != LLAMA_ROPE_TYPE_NORM &&
                                                           hparams.rope_type != LLAMA_ROPE_TYPE_NEOX)) {
            grp.ea_sum.clear(); // a portable context of a model whose RoPE EA cannot follow collects no statistics
            grp.ea_sq.clear();
            continue;
        }
        const int32_t il = grp.layers.front();
        if (hparams.rope_type != LLAMA_ROPE_TYPE_NORM && hparams.rope_type != LLAMA_ROPE_TYPE_NEOX) {
            throw std::runtime_error("PolyKV: expected_attention (layer " + std::to_string(il) + ") needs a model with plain RoPE "
                                     "(norm or neox); this model's RoPE type is " + std::to_string((int) hparams.rope_type));
        }
        grp.rope.n_rot      = (int32_t) hparams.n_rot(il);
        grp.rope.mode       = hparams.rope_type;
        grp.rope.freq_base  = mdl.get_rope_freq_base(cparams, il);
        grp.rope.freq_scale = mdl.get_rope_freq_scale(cparams, il);
    }
}

size_t llama_kv_cache_poly::group_bytes(uint32_t g) const {
    size_t total = 0;
    for (const auto & [buft, size] : groups[g].kv->memory_breakdown()) {
        total += size;
    }
    return total;
}

static const uint32_t POLYKV_STATE_MAGIC    = 0x504b5636; // "PKV6": PKV5 + the open prompt chunk (chunked prefill)
static const uint32_t POLYKV_STATE_MAGIC_V5 = 0x504b5635; // "PKV5": PKV4 + budgets a per-prompt allocation gave + KVzip scores
static const uint32_t POLYKV_STATE_MAGIC_V4 = 0x504b5634; // "PKV4": still read

// after each group's cells: the score state of every kept token, keyed by position (a restore may place
// tokens in other cells), so that a restored cache goes on evicting as the saved one would have
void llama_kv_cache_poly::state_write(llama_io_write_i & io, llama_seq_id seq_id, llama_state_seq_flags flags) const {
    const uint32_t n = groups.size();
    const uint8_t pending = prompt_pending ? 1 : 0;
    const uint8_t prev_output = feed.prev_output ? 1 : 0;
    io.write(&POLYKV_STATE_MAGIC, sizeof(POLYKV_STATE_MAGIC));
    io.write(&n, sizeof(n));
    io.write(&pending, sizeof(pending));
    io.write(&feed.n_open, sizeof(feed.n_open));
    io.write(&prev_output, sizeof(prev_output));
    for (const auto & grp : groups) {
        io.write(&grp.capacity, sizeof(grp.capacity));
        // budgets a per-prompt allocation gave this prompt (the plan's own are not written: any plan of the same
        // sizes, e.g. every portable one, may load the state)
        const uint8_t allocated = grp.phase[0].budget != grp.plan_budget[0] || grp.phase[1].budget != grp.plan_budget[1];
        io.write(&allocated, sizeof(allocated));
        if (allocated) {
            io.write(&grp.phase[0].budget, sizeof(int32_t));
            io.write(&grp.phase[1].budget, sizeof(int32_t));
        }
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
        // (2: a pooled group whose slots hold other heads' tokens, with each slot's owner after its position)
        bool heads_differ = false;
        bool owners_moved = false;
        for (uint32_t h = 0; grp.per_head && h < grp.n_head_kv; ++h) {
            for (uint32_t i : idxs) {
                const size_t u = (size_t) h*grp.capacity + i;
                heads_differ |= grp.hpos[u] != cells.pos_get(i);
                owners_moved |= grp.hpos[u] >= 0 && grp.owner_of(u) != h;
            }
        }
        const uint8_t head_scores = grp.head_scores() ? 1 : 0;
        const uint8_t per_head    = owners_moved ? 2 : heads_differ ? 1 : 0;
        io.write(&head_scores, sizeof(head_scores));
        io.write(&per_head, sizeof(per_head));
        if (grp.head_scores()) {
            for (uint32_t h = 0; h < grp.n_head_kv; ++h) {
                const size_t off = grp.head_off(h);
                for (uint32_t i : idxs) {
                    if (per_head) {
                        io.write(&grp.hpos[(size_t) h*grp.capacity + i], sizeof(llama_pos));
                    }
                    if (per_head == 2) {
                        const uint8_t owner = (uint8_t) grp.owner_of((size_t) h*grp.capacity + i);
                        io.write(&owner, sizeof(owner));
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
        // KVzip: the reconstruction scores of a prompt scored and not compressed yet, every slot
        // (the layer's slot if it has one, then each KV head's if it has them)
        const uint8_t has_zmax = kvzip_scored && prompt_pending ? 1 : 0;
        io.write(&has_zmax, sizeof(has_zmax));
        if (has_zmax) {
            const uint8_t  layer_slot = grp.layer_scores() ? 1 : 0;
            const uint32_t n_heads    = grp.head_scores() ? grp.n_head_kv : 0;
            io.write(&layer_slot, sizeof(layer_slot));
            io.write(&n_heads, sizeof(n_heads));
            for (uint32_t k = 0; k < grp.n_slots(); ++k) {
                for (uint32_t i : idxs) {
                    io.write(&grp.zmax[(size_t) k*grp.capacity + i], sizeof(float));
                }
            }
        }
        // Expected Attention: the query statistics (a portable state carries them for every layer)
        const uint8_t has_ea = grp.ea_sum.empty() ? 0 : 1;
        io.write(&has_ea, sizeof(has_ea));
        if (has_ea) {
            const uint32_t n_sum = grp.ea_sum.size();
            const uint32_t n_sq  = grp.ea_sq.size();
            io.write(&grp.ea_n, sizeof(grp.ea_n));
            io.write(&n_sum, sizeof(n_sum));
            io.write(&n_sq,  sizeof(n_sq));
            io.write(grp.ea_sum.data(), n_sum * sizeof(double));
            io.write(grp.ea_sq.data(),  n_sq  * sizeof(double));
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
    if ((magic != POLYKV_STATE_MAGIC && magic != POLYKV_STATE_MAGIC_V5 && magic != POLYKV_STATE_MAGIC_V4) || n != groups.size()) {
        throw std::runtime_error("PolyKV: the saved state does not come from a context with the same plan "
                                 "(or, in portable prefill mode, from another portable context of this model)");
    }
    feed_state saved_feed;
    if (magic == POLYKV_STATE_MAGIC) {
        uint8_t prev_output = 1;
        io.read(&saved_feed.n_open, sizeof(saved_feed.n_open));
        io.read(&prev_output, sizeof(prev_output));
        saved_feed.prev_output = prev_output != 0;
    }
    // a chunk longer than this context's ubatch (saved with a larger one) is evicted before the next prompt ubatch
    const bool feed_known = magic == POLYKV_STATE_MAGIC && saved_feed.n_open < n_ubatch;
    if (!feed_known) {
        saved_feed.n_open = 0;
    }
    // a prompt saved before its compression is compressed at the next decode step (exact modes, slack)
    prompt_pending = compresses_at_decode() && pending != 0;
    kvzip_scored = false;
    // the prompt chunk left open when the state was saved goes on filling (older formats do not record it: the
    // next prompt ubatch evicts it if it does not fit)
    feed = saved_feed;
    open_unknown = !feed_known;
    bool scored = prompt_pending; // a prompt saved scored by the pass, not compressed yet, carries its scores
    restore_plan_budgets();
    for (uint32_t g = 0; g < groups.size(); ++g) {
        auto & grp = groups[g];
        uint32_t cap = 0;
        uint8_t  allocated = 0;
        io.read(&cap, sizeof(cap));
        if (magic != POLYKV_STATE_MAGIC_V4) {
            io.read(&allocated, sizeof(allocated));
        }
        if (allocated) {
            int32_t budget[2] = { 0, 0 };
            io.read(budget, sizeof(budget));
            const bool fits = budget[0] >= 0 && budget[0] <= (int32_t) n_ctx && budget[1] >= -1 && budget[1] <= (int32_t) n_ctx &&
                              (budget[1] >= 0) == (grp.plan_budget[1] >= 0);
            // chunked prefill allocates within what a layer holds when the prompt ends (allocate_pool)
            const bool held = prefill_exact || budget[0] <= streaming_phase(grp.phase[0]).budget;
            if (!plan.allocation_prompt || !fits || !held) {
                throw std::runtime_error("PolyKV: the saved state holds budgets a per-prompt allocation gave its prompt; it loads into a "
                                         "context whose plan has \"allocation\": \"prompt\" too (chunked: with the same prefill slack)");
            }
            grp.phase[0].budget = budget[0];
            grp.phase[1].budget = budget[1];
        }
        // exact modes save either the whole prompt's caches or the compressed ones of the same plan (at the budgets
        // read above); kept follow-ups grew the caches by what came after the compression, up to n_ctx
        const bool whole_or_compressed = prefill_exact && (cap == grp.capacity_max || cap == group_cells(grp, false));
        const bool grown = plan.followup_keep && cap > group_cells(grp, false) && cap <= n_ctx;
        if (cap != grp.capacity && (whole_or_compressed || grown)) {
            reset_capacity(grp, cap);
        }
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
        // a state of this context's plan holds at most its cells and its observation window of rows; anything
        // larger is another plan's state or a damaged file, and must not size an allocation
        if (n_cells > grp.capacity || n_ring > (uint32_t) std::max(grp.ring_size(), 0)) {
            throw std::runtime_error("PolyKV state: group " + std::to_string(g) + " holds " + std::to_string(n_cells) +
                                     " cells and " + std::to_string(n_ring) + " score rows, this context at most " +
                                     std::to_string(grp.capacity) + " and " + std::to_string(std::max(grp.ring_size(), 0)) +
                                     " (a state of another plan, or a damaged file)");
        }
        std::fill(grp.acc.begin(), grp.acc.end(), 0.0f);
        std::fill(grp.last.begin(), grp.last.end(), 0.0f);
        std::fill(grp.knorm.begin(), grp.knorm.end(), 0.0f);
        grp.ring.assign(n_ring, std::vector<float>((size_t) grp.n_slots() * grp.capacity, 0.0f));
        grp.ring_changed();
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
        if (per_head > 2 || (per_head == 2 && !grp.pooled)) {
            throw std::runtime_error("PolyKV: the saved state's layer " + std::to_string(grp.layers.front()) + " holds adaptive "
                                     "heads in pooled slots, which this context does not (another plan, or flash attention off)");
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
                    if (grp.pooled) {
                        grp.howner[(size_t) h*grp.capacity + c] = (uint8_t) h;
                    }
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
                    if (per_head == 2) {
                        uint8_t owner = 0;
                        io.read(&owner, sizeof(owner));
                        if (owner >= grp.n_head_kv) {
                            throw std::runtime_error("PolyKV state: a slot of layer " + std::to_string(grp.layers.front()) +
                                                     " names KV head " + std::to_string(owner) + " (a damaged file)");
                        }
                        grp.howner[(size_t) h*grp.capacity + c] = owner;
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
        uint8_t has_zmax = 0;
        if (magic != POLYKV_STATE_MAGIC_V4) {
            io.read(&has_zmax, sizeof(has_zmax));
        }
        std::fill(grp.zmax.begin(), grp.zmax.end(), 0.0f);
        scored = scored && (has_zmax || !grp.needs(LLAMA_POLYKV_KVZIP));
        if (has_zmax) {
            uint8_t  layer_slot = 0;
            uint32_t n_heads = 0;
            io.read(&layer_slot, sizeof(layer_slot));
            io.read(&n_heads, sizeof(n_heads));
            if ((n_heads != 0 && n_heads != grp.n_head_kv) || used.size() != n_cells) {
                throw std::runtime_error("PolyKV state: group " + std::to_string(g) + " has KVzip scores of " +
                                         std::to_string(n_heads) + " KV heads (a state of another model, or a damaged file)");
            }
            std::vector<float> saved((size_t) (layer_slot + n_heads) * used.size());
            io.read(saved.data(), saved.size() * sizeof(float));
            const float * heads = saved.data() + (size_t) layer_slot * used.size();
            // slots by meaning: a layer's score is the largest of its KV heads' (each the largest over its query
            // heads), so per-head scores serve a per-layer slot; the reverse cannot be derived
            if (grp.layer_scores()) {
                for (size_t k = 0; k < used.size(); ++k) {
                    float z = layer_slot ? saved[k] : 0.0f;
                    for (uint32_t h = 0; !layer_slot && h < n_heads; ++h) {
                        z = std::max(z, heads[(size_t) h*used.size() + k]);
                    }
                    grp.zmax[used[k]] = z;
                }
                scored = scored && (layer_slot || n_heads > 0);
            }
            if (grp.head_scores()) {
                for (uint32_t h = 0; h < n_heads; ++h) {
                    for (size_t k = 0; k < used.size(); ++k) {
                        grp.zmax[grp.head_off(h) + used[k]] = heads[(size_t) h*used.size() + k];
                    }
                }
                scored = scored && n_heads > 0;
            }
        }
        uint8_t has_ea = 0;
        io.read(&has_ea, sizeof(has_ea));
        std::fill(grp.ea_sum.begin(), grp.ea_sum.end(), 0.0);
        std::fill(grp.ea_sq.begin(), grp.ea_sq.end(), 0.0);
        grp.ea_n = 0.0;
        if (has_ea) {
            double n_q = 0.0;
            uint32_t n_sum = 0;
            uint32_t n_sq  = 0;
            io.read(&n_q, sizeof(n_q));
            io.read(&n_sum, sizeof(n_sum));
            io.read(&n_sq,  sizeof(n_sq));
            const int32_t il = grp.layers.front();
            const size_t d = hparams.n_embd_head_k(il);
            const size_t n_head = hparams.n_head(il);
            if (n_sum != n_head * d || n_sq != n_head * d * d || !(n_q >= 0.0)) {
                throw std::runtime_error("PolyKV state: group " + std::to_string(g) + " has query statistics of another shape "
                                         "(a state of another model, or a damaged file)");
            }
            if (grp.ea_sum.empty()) {
                std::vector<double> skip(n_sq);
                io.read(skip.data(), n_sum * sizeof(double));
                io.read(skip.data(), n_sq * sizeof(double));
            } else {
                grp.ea_n = n_q;
                io.read(grp.ea_sum.data(), n_sum * sizeof(double));
                io.read(grp.ea_sq.data(),  n_sq  * sizeof(double));
            }
        }
    }
    // the newest token the state holds (the state does not record the logical end of the sequence)
    pos_next = 0;
    pos_next = seq_pos_max(seq) + 1;
    prompt_done = pos_next > 0 && !prompt_pending; // a cache saved after its compression (or while decoding)
    kvzip_scored = scored && pos_next > 0;
}

llama_polykv_phase_plan llama_kv_cache_poly::prompt_phase(const group & grp) const {
    const auto & pre = grp.phase[LLAMA_POLYKV_PHASE_PREFILL];
    if (keeps_followups()) {
        return llama_polykv_phase_plan(); // FullKV: nothing fed after the compression is evicted
    }
    if (!prompt_done || !plan.followup_decode || pre.pattern == LLAMA_POLYKV_FULLKV) {
        return pre;
    }
    llama_polykv_phase_plan res = grp.phase[LLAMA_POLYKV_PHASE_DECODE];
    if (res.pattern != LLAMA_POLYKV_FULLKV) {
        res.budget = pre.budget;
    }
    return res;
}

llama_polykv_phase_plan llama_kv_cache_poly::streaming_phase(const llama_polykv_phase_plan & pp) const {
    llama_polykv_phase_plan res = pp;
    if (prefill_slack > 1.0f && pp.pattern != LLAMA_POLYKV_FULLKV && pp.budget >= 0) {
        res.budget = (int32_t) std::min<double>(n_ctx, std::ceil((double) pp.budget * prefill_slack));
    }
    return res;
}

// decode `tokens` as sequence seq at positions p0, p0 + 1, ... (no outputs; pieces of at most n_batch tokens), then
// remove everything from p0 on: the passes whose queries score the cache and leave no trace (KVzip, a probe).
// Returns the first non-zero code of llama_decode, else 0
static int32_t decode_transient(llama_context * lctx, llama_seq_id seq, const std::vector<llama_token> & tokens,
                                llama_pos p0) {
    const int32_t n = (int32_t) tokens.size();
    const int32_t n_batch = (int32_t) llama_n_batch(lctx);
    llama_batch batch = llama_batch_init(std::max(1, std::min(n_batch, n)), 0, 1);
    int32_t rc = 0;
    for (int32_t i0 = 0; i0 < n && rc == 0; i0 += n_batch) {
        batch.n_tokens = 0;
        for (int32_t i = i0; i < std::min(n, i0 + n_batch); ++i) {
            const int32_t k = batch.n_tokens++;
            batch.token   [k]    = tokens[i];
            batch.pos     [k]    = p0 + i;
            batch.n_seq_id[k]    = 1;
            batch.seq_id  [k][0] = seq;
            batch.logits  [k]    = false;
        }
        rc = llama_decode(lctx, batch);
    }
    llama_batch_free(batch);
    llama_memory_seq_rm(llama_get_memory(lctx), seq, p0, -1);
    return rc;
}

void llama_kv_cache_poly::before_ubatch(const llama_ubatch & ubatch) {
    bool no_room = false;
    if (open_unknown && chunks_aligned() && !is_decode(ubatch) && !keeps_followups()) {
        for (const auto & grp : groups) {
            no_room |= grp.stream < 0 && n_used_cells(grp) + ubatch.n_tokens > grp.capacity;
        }
    }
    open_unknown = false;
    if (no_room || (feed.n_open > 0 && (!chunks_aligned() || is_decode(ubatch) || feed.n_open + ubatch.n_tokens > n_ubatch))) {
        // the prompt's open chunk ends here (decoding starts, or a ubatch that init_batch did not cut comes):
        // it evicts as it would have after its last ubatch (an open chunk means no group streams)
        evict_streaming(true);
        feed.n_open = 0;
    }
    for (auto & grp : groups) {
        grp.rows_idle = decode_rows_idle(grp, ubatch);
    }
    if (!prompt_pending || kvzip_active || probe_active) {
        return;
    }
    if (is_decode(ubatch)) {
        compress_prompt();
        return;
    }
    // more of the prompt: the streaming groups (and, when no probe came after the last prompt ubatch, every group)
    // make room for it
    evict_streaming(false);
}

uint64_t llama_kv_cache_poly::evict_streaming(bool by_prompt_pattern) {
    uint64_t n_freed = 0;
    for (auto & grp : groups) {
        const uint64_t n0 = grp.n_evicted;
        if (grp.stream >= 0 && !by_prompt_pattern) {
            evict(grp, stream_phase(grp));
        } else if (probe_due || by_prompt_pattern) {
            warn_kvzip_unscored(grp);
            evict(grp, streaming_phase(prompt_phase(grp)));
        }
        n_freed += grp.n_evicted - n0;
    }
    probe_due = false;
    return n_freed;
}

void llama_kv_cache_poly::set_prompt_probing(bool on) {
    if (on && prefill_exact) {
        throw std::runtime_error("probing scores a prompt that streams (chunked prefill); exact prefill keeps the "
                                 "whole prompt and compresses it with its last tokens anyway");
    }
    probing = on;
}

uint64_t llama_kv_cache_poly::probe_prompt(llama_context * lctx, const llama_token * tokens, int32_t n_tokens) {
    if (!probing) {
        throw std::runtime_error("no probing: turn it on (llama_polykv_set_prompt_probing) before the prompt");
    }
    if (!tokens || n_tokens <= 0) {
        throw std::runtime_error("a probe needs at least one token");
    }
    if (!probe_due) {
        return 0; // nothing fed since the last probe or compression
    }
    const llama_pos p0 = pos_next;
    if ((uint64_t) p0 + n_tokens > n_ctx) {
        throw std::runtime_error("the probe needs n_ctx >= prompt so far + probe = " + std::to_string(p0 + n_tokens) +
                                 " (n_ctx " + std::to_string(n_ctx) + ")");
    }
    probe_active = true;
    const int32_t rc = decode_transient(lctx, seq, std::vector<llama_token>(tokens, tokens + n_tokens), p0);
    probe_active = false;
    if (rc != 0) {
        throw std::runtime_error("the probe failed (llama_decode returned " + std::to_string(rc) + "): it needs " +
                                 std::to_string(n_tokens) + " free cells in every layer; feed the prompt in pieces of "
                                 "at most n_ubatch - " + std::to_string(n_tokens) + " tokens");
    }
    return evict_streaming(true);
}

llama_polykv_phase_plan llama_kv_cache_poly::stream_phase(const group & grp) const {
    llama_polykv_phase_plan res = streaming_phase(prompt_phase(grp));
    if (grp.stream >= 0 && res.pattern != LLAMA_POLYKV_FULLKV) {
        res.pattern = (llama_polykv_pattern) grp.stream;
    }
    return res;
}

uint64_t llama_kv_cache_poly::compress_prompt() {
    uint64_t n_freed = 0;
    if (plan.allocation_prompt && !prompt_done) {
        allocate_prompt();
    }
    for (auto & grp : groups) {
        warn_kvzip_unscored(grp);
        const uint64_t n0 = grp.n_evicted;
        evict(grp, prompt_phase(grp));
        n_freed += grp.n_evicted - n0;
        if (prefill_exact && grp.n_evicted > n0 && !grp.per_head) { // per-head eviction repacks by itself
            compact(grp);
        }
        // exact modes hold the whole prompt in n_ctx cells until now: give back what the plan no longer needs
        // (kept follow-ups may hold more than the plan's budget)
        const uint32_t cap = std::max(group_cells(grp, false), std::min(n_ctx, pad_to(n_used_cells(grp) + n_ubatch, grp.pad)));
        if (prefill_exact && cap < grp.capacity) {
            resize(grp, cap);
        }
    }
    prompt_pending = false;
    prompt_done = true;
    probe_due = false;
    feed.n_open = 0;
    return n_freed;
}

void llama_kv_cache_poly::warn_kvzip_unscored(const group & grp) {
    if (grp.phase[LLAMA_POLYKV_PHASE_PREFILL].pattern == LLAMA_POLYKV_KVZIP && !kvzip_scored && !kvzip_warned) {
        LLAMA_LOG_WARN("%s: PolyKV: a kvzip layer compresses a prompt that no reconstruction pass scored (chunked prefill, "
                       "or no llama_polykv_compress_prompt_kvzip call): it keeps its sinks and its most recent tokens\n", __func__);
        kvzip_warned = true;
    }
}

uint64_t llama_kv_cache_poly::compress_prompt_kvzip(llama_context * lctx, const llama_token * prefix, int32_t n_prefix,
                                                   const llama_token * tokens, int32_t n_tokens, int32_t n_chunk) {
    score_prompt_kvzip(lctx, prefix, n_prefix, tokens, n_tokens, n_chunk);
    return compress_prompt();
}

void llama_kv_cache_poly::score_prompt_kvzip(llama_context * lctx, const llama_token * prefix, int32_t n_prefix,
                                             const llama_token * tokens, int32_t n_tokens, int32_t n_chunk) {
    if (!prefill_exact) {
        throw std::runtime_error("KVzip scores the whole prompt at once: it needs exact prefill (prefill mode exact or portable)");
    }
    const llama_pos n_prompt = seq_pos_max(seq) + 1;
    if (!prompt_pending || n_prompt <= 0) {
        throw std::runtime_error("KVzip: no uncompressed prompt in the cache (call it after the prompt, before the first decode step)");
    }
    if (n_tokens != n_prompt || !tokens || n_prefix < 0 || (n_prefix > 0 && !prefix)) {
        throw std::runtime_error("KVzip: give the prompt's " + std::to_string(n_prompt) + " tokens (got " + std::to_string(n_tokens) + ")");
    }
    if (n_chunk <= 0) {
        n_chunk = n_tokens;
    }
    n_chunk = std::min(n_chunk, n_tokens);
    if ((uint32_t) (n_prompt + n_prefix + n_chunk) > n_ctx) {
        throw std::runtime_error("KVzip: the reconstruction of a chunk needs n_ctx >= prompt + prefix + chunk = " +
                                 std::to_string(n_prompt + n_prefix + n_chunk) + " (n_ctx " + std::to_string(n_ctx) + "); use a smaller chunk");
    }
    for (auto & grp : groups) {
        std::fill(grp.zmax.begin(), grp.zmax.end(), 0.0f);
    }
    kvzip_active = true;
    int32_t rc = 0;
    for (int32_t c0 = 0; c0 < n_tokens && rc == 0; c0 += n_chunk) {
        const int32_t n_part = std::min(n_chunk, n_tokens - c0);
        // a chunk after the first starts with the last tokens before it (kvpress: "starting with" the previous
        // chunk's last 8), so the copy resumes where it was; as many as n_ctx leaves room for
        const int32_t n_overlap = std::max(0, std::min({ 8, c0, (int32_t) n_ctx - (n_prompt + n_prefix + n_part) }));
        std::vector<llama_token> recon(prefix, prefix + n_prefix);
        recon.insert(recon.end(), tokens + c0 - n_overlap, tokens + c0 + n_part);
        rc = decode_transient(lctx, seq, recon, n_prompt);
    }
    kvzip_active = false;
    if (rc != 0) {
        throw std::runtime_error("KVzip: the reconstruction pass failed (llama_decode returned " + std::to_string(rc) + ")");
    }
    llama_synchronize(lctx);
    kvzip_scored = true;
}

bool llama_kv_cache_poly::decode_evict_due(const group & grp) const {
    return decode_tokens_to_eviction(grp) == 0;
}

uint64_t llama_kv_cache_poly::decode_tokens_to_eviction(const group & grp) const {
    const auto & pp = grp.phase[LLAMA_POLYKV_PHASE_DECODE];
    if (plan.evict_every <= 1 || pp.pattern == LLAMA_POLYKV_FULLKV || pp.budget < 0) {
        return 0; // every step (FullKV and sliding-window recycling are evict()'s business)
    }
    // tokens held per KV head (an adaptive layer: all heads together, against n_head_kv budgets)
    uint64_t held = 0;
    uint64_t n_units = 1;
    if (grp.per_head) {
        std::vector<uint64_t> per(grp.n_head_kv, 0);
        for (size_t u = 0; u < grp.hpos.size(); ++u) {
            per[grp.owner_of(u)] += grp.hpos[u] >= 0;
        }
        if (pp.selection == LLAMA_POLYKV_SELECT_ADAPTIVE) {
            for (uint64_t x : per) {
                held += x;
            }
            n_units = grp.n_head_kv;
        } else {
            held = *std::max_element(per.begin(), per.end());
        }
    } else {
        held = n_used_cells(grp);
    }
    // due once evict_every tokens above the budget, or when the next token would find no free cell; a decode
    // token adds one token to every head (n_units to an adaptive layer's sum) and takes one cell
    const uint64_t due_held = n_units * ((uint64_t) pp.budget + plan.evict_every);
    const uint64_t used = n_used_cells(grp);
    const uint64_t by_held = held >= due_held ? 0 : (due_held - held + n_units - 1) / n_units;
    const uint64_t by_cells = used >= grp.capacity ? 0 : grp.capacity - used;
    return std::min(by_held, by_cells);
}

bool llama_kv_cache_poly::decode_rows_idle(const group & grp, const llama_ubatch & ubatch) const {
    const auto & pp = grp.phase[LLAMA_POLYKV_PHASE_DECODE];
    if (plan.evict_every <= 1 || ubatch.n_tokens != 1 || !is_decode(ubatch) || prompt_pending || kvzip_active ||
        probe_active || keeps_followups() || grp.collect_all || grp.needs(LLAMA_POLYKV_H2O)) {
        return false; // H2O adds every row to its accumulator
    }
    // the rows the decode pattern reads at an eviction: its observation window (SnapKV, PyramidKV) or the last
    // query's (TOVA); positional and key-norm patterns read none
    uint64_t w = 0;
    if (pp.pattern == LLAMA_POLYKV_SNAPKV || pp.pattern == LLAMA_POLYKV_PYRAMIDKV) {
        w = (uint64_t) std::max(grp.ring_size(), 1);
    } else if (pp.pattern == LLAMA_POLYKV_TOVA) {
        w = 1;
    }
    // the eviction comes after this token (to_go 1) or after one of the next w - 1: its rows are in the window
    const uint64_t to_go = decode_tokens_to_eviction(grp);
    return to_go > w;
}

void llama_kv_cache_poly::after_ubatch(llama_context * lctx, const llama_ubatch & ubatch) {
    bool any_scores = false;
    for (const auto & grp : groups) {
        any_scores |= grp.t_rows != nullptr || grp.t_rows_heads != nullptr || grp.t_knorm != nullptr || grp.t_ea_sum != nullptr;
    }
    if (any_scores || prefill_exact) {
        // wait for the scores (and, in exact modes, for the cache writes a compaction may read before the next
        // ubatch); not llama_synchronize(), which would book the whole batch's timing now
        ggml_backend_sched_synchronize(lctx->get_sched());
        fetch_scores(lctx->get_sched());
    }
    if (kvzip_active) {
        for (auto & grp : groups) {
            read_kvzip(grp);
        }
        return; // the reconstruction tokens leave the cache after each chunk; nothing is evicted
    }
    if (probe_active) {
        for (auto & grp : groups) {
            read_scores(grp, ubatch.n_tokens, false);
        }
        return; // probe_prompt evicts once the probe has left the cache
    }
    const bool decode = is_decode(ubatch);
    const int phase = decode ? LLAMA_POLYKV_PHASE_DECODE : LLAMA_POLYKV_PHASE_PREFILL;
    const int64_t t_start_us = ggml_time_us();
    feed = feed_after(feed, ubatch);
    for (auto & grp : groups) {
        read_scores(grp, ubatch.n_tokens);
        if (grp.rows_idle) {
            // the ring keeps only consecutive recent rows: a prompt fed before the next eviction is scored by its
            // own queries and the decode rows computed since, not by rows older than the skipped steps
            grp.clear_ring();
            grp.rows_idle = false;
        }
        if (decode) {
            if (!keeps_followups() && decode_evict_due(grp)) {
                evict(grp, grp.phase[phase]);
            }
        } else if (!prefill_exact && grp.stream < 0 && !probing && feed.n_open == 0) {
            warn_kvzip_unscored(grp);
            evict(grp, streaming_phase(prompt_phase(grp)));
        } // a streaming group evicts before the next prompt ubatch (before_ubatch), or compresses when decoding starts
    }
    probe_due = probing && !prefill_exact && !decode;
    prompt_pending = compresses_at_decode() && !decode;
    prompt_done = prompt_done || decode;
    if (decode) {
        t_decode_select_us += ggml_time_us() - t_start_us;
        n_decode_steps += 1;
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

llama_kv_cache_poly_context::llama_kv_cache_poly_context(const llama_kv_cache_poly_seqs * seqs, std::vector<llama_kv_cache_poly *> ubatch_kv,
                                                         std::vector<llama_ubatch> ubatches) :
    status(LLAMA_MEMORY_STATUS_SUCCESS), ubatches(std::move(ubatches)), ubatch_kv(std::move(ubatch_kv)), seqs(seqs) {
    kv = ubatch_cache(0);
}

llama_kv_cache_poly * llama_kv_cache_poly_context::ubatch_cache(size_t i) const {
    // a ubatch of several sequences (nullptr): the cache of its first token's sequence
    return ubatch_kv[i] ? ubatch_kv[i] : seqs->get_seq(ubatches[i].seq_id[0][0]);
}

bool llama_kv_cache_poly_context::next() {
    assert(status == LLAMA_MEMORY_STATUS_SUCCESS);
    if (++i_cur >= ubatches.size()) {
        return false;
    }
    if (!ubatch_kv.empty()) {
        kv = ubatch_cache(i_cur);
        group_ctxs.clear();
        parts.clear();
    }
    return true;
}

bool llama_kv_cache_poly_context::apply() {
    assert(!llama_memory_status_is_fail(status));
    if (ubatches.empty()) {
        return true;
    }
    // lazy slotting: the cells freed by the eviction after the previous ubatch are reused now
    const auto & ubatch = ubatches[i_cur];
    if (!ubatch_kv.empty() && !ubatch_kv[i_cur]) {
        // several sequences: each sequence's tokens go to its own caches, as if they were a ubatch of their own
        parts.clear();
        for (const auto & [i0, n] : llama_polykv_ubatch_seq_runs(ubatch)) {
            auto * poly = seqs->get_seq(ubatch.seq_id[i0][0]);
            parts.push_back(std::make_unique<llama_kv_cache_poly_context>(poly,
                    std::vector<llama_ubatch>{ llama_polykv_ubatch_rows(ubatch, i0, n) }));
            if (!parts.back()->apply()) {
                return false;
            }
        }
        return true;
    }
    try {
        group_ctxs.clear(); // they refer to the groups' caches, which a compression may replace
        kv->before_ubatch(ubatch); // may compress the prompt (exact modes); no exception may leave llama_decode
    } catch (const std::exception & e) {
        LLAMA_LOG_ERROR("%s: PolyKV: compressing the prompt failed: %s\n", __func__, e.what());
        return false;
    }
    for (uint32_t g = 0; g < kv->n_groups(); ++g) {
        auto & grp = kv->get_group(g);
        auto sinfo = grp.kv->find_slot(ubatch, false);
        if (sinfo.empty()) {
            try {
                if (kv->make_room(grp, ubatch.n_tokens)) {
                    sinfo = grp.kv->find_slot(ubatch, false);
                }
            } catch (const std::exception & e) {
                LLAMA_LOG_ERROR("%s: PolyKV: growing group %u failed: %s\n", __func__, g, e.what());
                return false;
            }
        }
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
    if (plan.n_layer != (int32_t) hparams.n_layer() && source.rfind("file ", 0) == 0) {
        // LLAMA_POLYKV_PLAN reaches every model of the process (a speculative draft, an embedding model): it
        // applies to the models it was made for
        LLAMA_LOG_WARN("%s: PolyKV: LLAMA_POLYKV_PLAN is a plan for %d layers; this model (%s) has %u: it runs without a plan\n",
                       __func__, plan.n_layer, llm_arch_name(model.arch), hparams.n_layer());
        return nullptr;
    }
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
    if (const char * env = getenv("LLAMA_POLYKV_EVICT_EVERY")) {
        // the stock tools' way to batch decode eviction (polykv-cpp run --evict-every)
        char * end = nullptr;
        const long v = strtol(env, &end, 10);
        if (end == env || *end != '\0' || v < 1 || v > LLAMA_POLYKV_MAX_EVICT_EVERY) {
            throw std::runtime_error(std::string("PolyKV: LLAMA_POLYKV_EVICT_EVERY must be an integer from 1 to ") +
                                     std::to_string(LLAMA_POLYKV_MAX_EVICT_EVERY) + ", got '" + env + "'");
        }
        plan.evict_every = (int32_t) v;
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
            if (v != "chunked" && v != "exact" && v != "portable") {
                throw std::runtime_error("PolyKV: LLAMA_POLYKV_PREFILL must be chunked, exact or portable, got '" + v + "'");
            }
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
        } else if (plan.prefill_slack >= 1.0f) {
            prefill_slack = plan.prefill_slack;
        }
    }
    // one cache per sequence: each keeps the plan's budgets, and sequences never evict each other's tokens
    const uint32_t n_seq = std::max<uint32_t>(cparams.n_seq_max, 1);
    std::vector<std::unique_ptr<llama_kv_cache_poly>> seqs;
    for (uint32_t s = 0; s < n_seq; ++s) {
        seqs.push_back(std::make_unique<llama_kv_cache_poly>(model, hparams, plan, prefill_mode, prefill_slack, params.type_k,
                                                             params.type_v, !cparams.flash_attn, cparams.offload_kqv,
                                                             cparams.n_ctx_seq, cparams.n_ubatch, (llama_seq_id) s, n_seq));
        seqs.back()->set_rope(model, cparams);
    }
    uint64_t cells = 0;
    uint64_t bytes = 0;
    for (const auto & mem : seqs) {
        for (uint32_t g = 0; g < mem->n_groups(); ++g) {
            cells += (uint64_t) mem->get_group(g).capacity * mem->get_group(g).layers.size();
            bytes += mem->group_bytes(g);
        }
    }
    const uint64_t full_cells = (uint64_t) cparams.n_ctx * hparams.n_layer();
    char slack_note[224] = "";
    if (prefill_mode == 0 && prefill_slack > 1.0f) {
        snprintf(slack_note, sizeof(slack_note), ", prefill slack %g", prefill_slack);
    }
    if (prefill_mode == 0 && plan.stream >= 0) {
        const size_t n = strlen(slack_note);
        snprintf(slack_note + n, sizeof(slack_note) - n, ", streaming by %s", llama_polykv_pattern_name(plan.stream));
    }
    if (plan.allocation_cap > 0.0f) {
        const size_t n = strlen(slack_note);
        snprintf(slack_note + n, sizeof(slack_note) - n, ", per-prompt budgets capped at %gx", plan.allocation_cap);
    }
    if (plan.protect_tail > 0) {
        const size_t n = strlen(slack_note);
        snprintf(slack_note + n, sizeof(slack_note) - n, ", the prompt's last %d tokens on top", plan.protect_tail);
    }
    char seq_note[64] = "";
    if (n_seq > 1) {
        snprintf(seq_note, sizeof(seq_note), ", %u sequences of %u positions each", n_seq, cparams.n_ctx_seq);
    }
    LLAMA_LOG_INFO("%s: PolyKV plan active (%s%s%s%s%s): %u layers in %u cache groups, %" PRIu64 " cells (FullKV: %" PRIu64 "), KV %.2f MiB = %.1f%% of FullKV\n",
            __func__, source.c_str(), kv_budget > 0 ? (", kv-budget " + std::to_string(kv_budget)).c_str() : "",
            prefill_mode == 1 ? ", exact prefill" : prefill_mode == 2 ? ", exact portable prefill" : "", slack_note, seq_note,
            hparams.n_layer(), seqs.front()->n_groups(), cells, full_cells, bytes / 1024.0 / 1024.0, 100.0 * cells / std::max<uint64_t>(full_cells, 1));
    if (n_seq == 1) {
        return seqs.front().release();
    }
    return new llama_kv_cache_poly_seqs(std::move(seqs), cparams.n_ctx);
}

llama_ubatch llama_polykv_ubatch_rows(const llama_ubatch & ubatch, uint32_t i0, uint32_t n) {
    GGML_ASSERT(i0 + n <= ubatch.n_tokens);
    if (i0 == 0 && n == ubatch.n_tokens) {
        return ubatch;
    }
    auto udata = std::make_shared<llama_ubatch::data_t>();
    const int64_t n_embd = ubatch.embd && ubatch.data ? (int64_t) ubatch.data->embd.size() / ubatch.n_tokens : 0;
    GGML_ASSERT(!ubatch.embd || n_embd > 0);
    udata->token.resize(n);
    udata->embd.resize(n_embd*n);
    udata->pos.resize((size_t) n*ubatch.n_pos);
    udata->n_seq_id.resize(n);
    udata->seq_id.resize(n);
    udata->seq_idx.resize(LLAMA_MAX_SEQ, -1);
    udata->output.resize(n);
    for (uint32_t i = 0; i < n; ++i) {
        const uint32_t src = i0 + i;
        if (ubatch.token) {
            udata->token[i] = ubatch.token[src];
        }
        if (n_embd > 0) {
            memcpy(udata->embd.data() + i*n_embd, ubatch.embd + src*n_embd, n_embd*sizeof(float));
        }
        for (uint32_t j = 0; j < ubatch.n_pos; ++j) {
            udata->pos[j*n + i] = ubatch.pos[j*ubatch.n_tokens + src];
        }
        udata->n_seq_id[i] = ubatch.n_seq_id[src];
        udata->output[i] = ubatch.output[src];
        for (int32_t s = 0; s < ubatch.n_seq_id[src]; ++s) {
            udata->seq_id_data.push_back(ubatch.seq_id[src][s]);
        }
    }
    llama_seq_id * ptr = udata->seq_id_data.data();
    for (uint32_t i = 0; i < n; ++i) {
        udata->seq_id[i] = ptr;
        ptr += udata->n_seq_id[i];
    }
    for (const llama_seq_id s : udata->seq_id_data) {
        if (udata->seq_idx[s] < 0) {
            udata->seq_idx[s] = (int32_t) udata->seq_id_unq.size();
            udata->seq_id_unq.push_back(s);
        }
    }
    llama_ubatch res {
        /*.b_equal_seqs =*/ 0,
        /*.n_tokens     =*/ n,
        /*.n_seq_tokens =*/ n,
        /*.n_seqs       =*/ 1,
        /*.n_seqs_unq   =*/ (uint32_t) udata->seq_id_unq.size(),
        /*.n_pos        =*/ ubatch.n_pos,
        /*.token        =*/ ubatch.token ? udata->token.data() : nullptr,
        /*.embd         =*/ n_embd > 0 ? udata->embd.data() : nullptr,
        /*.pos          =*/ udata->pos.data(),
        /*.n_seq_id     =*/ udata->n_seq_id.data(),
        /*.seq_id       =*/ udata->seq_id.data(),
        /*.seq_id_unq   =*/ udata->seq_id_unq.data(),
        /*.seq_idx      =*/ udata->seq_idx.data(),
        /*.output       =*/ udata->output.data(),
        /*.data         =*/ std::move(udata),
    };
    return res;
}

std::vector<std::pair<uint32_t, uint32_t>> llama_polykv_ubatch_seq_runs(const llama_ubatch & ubatch) {
    std::vector<std::pair<uint32_t, uint32_t>> runs;
    for (uint32_t i = 0; i < ubatch.n_tokens; ++i) {
        if (runs.empty() || ubatch.seq_id[i][0] != ubatch.seq_id[runs.back().first][0]) {
            runs.emplace_back(i, 0);
        }
        runs.back().second += 1;
    }
    return runs;
}

bool llama_polykv_after_ubatch(llama_context * lctx, llama_memory_i * mem, const llama_ubatch & ubatch) {
    std::vector<std::pair<llama_kv_cache_poly *, llama_ubatch>> parts;
    if (auto * poly = dynamic_cast<llama_kv_cache_poly *>(mem)) {
        parts.emplace_back(poly, ubatch);
    } else if (auto * seqs = dynamic_cast<llama_kv_cache_poly_seqs *>(mem)) {
        // a ubatch of several sequences: each sequence evicts after its own tokens
        for (const auto & [i0, n] : llama_polykv_ubatch_seq_runs(ubatch)) {
            parts.emplace_back(seqs->get_seq(ubatch.seq_id[i0][0]), llama_polykv_ubatch_rows(ubatch, i0, n));
        }
        if (parts.size() > 1) {
            seqs->count_shared(ubatch.n_tokens);
        }
    }
    for (auto & [poly, part] : parts) {
        try {
            poly->after_ubatch(lctx, part);
        } catch (const std::exception & e) { // no exception may leave llama_decode (a C function)
            LLAMA_LOG_ERROR("%s: PolyKV: evicting after a ubatch failed: %s\n", __func__, e.what());
            return false;
        }
    }
    return true;
}

uint32_t llama_polykv_graph_extra_nodes(const llama_memory_i * mem, uint32_t n_layer) {
    const auto * seqs = dynamic_cast<const llama_kv_cache_poly_seqs *>(mem);
    if (!seqs) {
        return 0;
    }
    // per sequence beyond the first and layer: row views, cache writes and views, attention, the score branch and
    // the concatenation (about 40 nodes with every score output on; a margin on top)
    const uint32_t n_shared = std::min<uint32_t>(seqs->n_seq(), LLAMA_POLYKV_MAX_SHARED_SEQS);
    return (n_shared - 1) * n_layer * 96;
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

// the cache of sequence seq_id (a context of one sequence has one cache, whatever seq_id)
static llama_kv_cache_poly * get_poly(const struct llama_context * ctx, llama_seq_id seq_id = 0) {
    llama_memory_i * mem = ctx ? llama_get_memory(ctx) : nullptr;
    if (auto * seqs = dynamic_cast<llama_kv_cache_poly_seqs *>(mem)) {
        return seqs->get_seq(seq_id);
    }
    return dynamic_cast<llama_kv_cache_poly *>(mem);
}

// every sequence's cache
static std::vector<llama_kv_cache_poly *> get_polys(const struct llama_context * ctx) {
    llama_memory_i * mem = ctx ? llama_get_memory(ctx) : nullptr;
    std::vector<llama_kv_cache_poly *> res;
    if (auto * seqs = dynamic_cast<llama_kv_cache_poly_seqs *>(mem)) {
        for (uint32_t s = 0; s < seqs->n_seq(); ++s) {
            res.push_back(seqs->get_seq(s));
        }
    } else if (auto * poly = dynamic_cast<llama_kv_cache_poly *>(mem)) {
        res.push_back(poly);
    }
    return res;
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
    int64_t n_freed = 0;
    try {
        for (auto * p : get_polys(ctx)) {
            n_freed += (int64_t) p->compress_prompt();
        }
    } catch (const std::exception & e) {
        set_last_error(e.what());
        return -1;
    }
    return n_freed;
}

// f(the context's cache of sequence 0) for a C API call: -1 and last_error without a plan or when f throws (no
// exception crosses the C API)
template <typename F>
static int64_t with_poly(struct llama_context * ctx, F f) {
    auto * poly = get_poly(ctx);
    if (!poly) {
        set_last_error("no PolyKV plan is active in this context");
        return -1;
    }
    try {
        return f(poly);
    } catch (const std::exception & e) {
        set_last_error(e.what());
        return -1;
    }
}

int64_t llama_polykv_compress_prompt_kvzip(struct llama_context * ctx, const llama_token * prefix, int32_t n_prefix,
                                           const llama_token * tokens, int32_t n_tokens, int32_t n_chunk) {
    return with_poly(ctx, [&](llama_kv_cache_poly * poly) {
        llama_synchronize(ctx);
        return (int64_t) poly->compress_prompt_kvzip(ctx, prefix, n_prefix, tokens, n_tokens, n_chunk);
    });
}

int32_t llama_polykv_score_prompt_kvzip(struct llama_context * ctx, const llama_token * prefix, int32_t n_prefix,
                                        const llama_token * tokens, int32_t n_tokens, int32_t n_chunk) {
    return (int32_t) with_poly(ctx, [&](llama_kv_cache_poly * poly) {
        llama_synchronize(ctx);
        poly->score_prompt_kvzip(ctx, prefix, n_prefix, tokens, n_tokens, n_chunk);
        return (int64_t) 0;
    });
}

int32_t llama_polykv_set_prompt_probing(struct llama_context * ctx, bool on) {
    return (int32_t) with_poly(ctx, [&](llama_kv_cache_poly * poly) {
        poly->set_prompt_probing(on);
        return (int64_t) 0;
    });
}

int32_t llama_polykv_get_decode_timing(const struct llama_context * ctx, double * select_ms, int64_t * n_steps) {
    const auto polys = get_polys(ctx);
    if (polys.empty()) {
        set_last_error("no PolyKV plan is active in this context");
        return -1;
    }
    int64_t us = 0;
    int64_t n  = 0;
    for (const auto * poly : polys) {
        us += poly->decode_select_us();
        n  += poly->decode_steps();
    }
    if (select_ms) {
        *select_ms = us / 1000.0;
    }
    if (n_steps) {
        *n_steps = n;
    }
    return 0;
}

int32_t llama_polykv_get_shared_ubatches(const struct llama_context * ctx, int64_t * n_ubatches, int64_t * n_tokens) {
    if (get_polys(ctx).empty()) {
        set_last_error("no PolyKV plan is active in this context");
        return -1;
    }
    const auto * seqs = dynamic_cast<const llama_kv_cache_poly_seqs *>(llama_get_memory(ctx));
    if (n_ubatches) {
        *n_ubatches = seqs ? seqs->shared_ubatches_done() : 0;
    }
    if (n_tokens) {
        *n_tokens = seqs ? seqs->shared_tokens_done() : 0;
    }
    return 0;
}

int32_t llama_polykv_get_device_repacks(const struct llama_context * ctx, int64_t * n_repacks) {
    const auto polys = get_polys(ctx);
    if (polys.empty()) {
        set_last_error("no PolyKV plan is active in this context");
        return -1;
    }
    int64_t n = 0;
    for (const auto * p : polys) {
        n += p->device_repacks();
    }
    if (n_repacks) {
        *n_repacks = n;
    }
    return 0;
}

int32_t llama_polykv_set_phase(struct llama_context * ctx, int32_t phase) {
    if (phase < -1 || phase > LLAMA_POLYKV_PHASE_DECODE) {
        set_last_error("phase " + std::to_string(phase) + ": expected -1 (auto), 0 (prefill) or 1 (decode)");
        return -1;
    }
    const auto polys = get_polys(ctx);
    if (polys.empty()) {
        set_last_error("no PolyKV plan is active in this context");
        return -1;
    }
    for (auto * poly : polys) {
        poly->set_phase(phase);
    }
    return 0;
}

int64_t llama_polykv_probe_prompt(struct llama_context * ctx, const llama_token * tokens, int32_t n_tokens) {
    return with_poly(ctx, [&](llama_kv_cache_poly * poly) {
        llama_synchronize(ctx);
        return (int64_t) poly->probe_prompt(ctx, tokens, n_tokens);
    });
}

int32_t llama_polykv_get_layer_stats(const struct llama_context * ctx, struct llama_polykv_layer_stats * out, int32_t n_max) {
    const auto polys = get_polys(ctx);
    if (polys.empty()) {
        return 0;
    }
    // several sequences: cells, evictions and bytes summed over the sequences' caches; FullKV is the stock cache of
    // the whole context, as llama.cpp's tools allocate it (a sliding-window layer: its SWA cache, not n_ctx cells)
    const auto * seqs = dynamic_cast<const llama_kv_cache_poly_seqs *>(llama_get_memory(ctx));
    const uint32_t n_ctx_total = seqs ? seqs->get_n_ctx_total() : polys.front()->get_n_ctx();
    int32_t n = 0;
    const int32_t n_layer = polys.front()->get_plan().n_layer;
    for (int32_t il = 0; il < n_layer; ++il) {
        const int32_t g = polys.front()->group_of(il);
        if (g < 0) {
            continue;
        }
        if (n < n_max && out) {
            const auto & grp = polys.front()->get_group(g);
            auto & s = out[n];
            s.layer           = il;
            s.group           = g;
            s.pattern_prefill = grp.phase[0].pattern;
            s.pattern_decode  = grp.phase[1].pattern;
            s.budget_prefill  = grp.phase[0].pattern == LLAMA_POLYKV_FULLKV ? -1 : grp.phase[0].budget;
            s.budget_decode   = grp.phase[1].pattern == LLAMA_POLYKV_FULLKV ? -1 : grp.phase[1].budget;
            s.capacity = 0;
            s.used = 0;
            s.n_evicted = 0;
            s.bytes = 0;
            for (const auto * poly : polys) {
                const auto & pg = poly->get_group(g);
                s.capacity  += pg.capacity;
                s.used      += pg.kv->get_cells(0).get_used();
                s.n_evicted += pg.n_evicted;
                s.bytes     += poly->group_bytes(g) / pg.layers.size();
            }
            const uint32_t n_fullkv = grp.is_swa ? polys.front()->stock_swa_cells(n_ctx_total, (uint32_t) polys.size()) : n_ctx_total;
            s.bytes_fullkv    = (uint64_t) ((double) s.bytes / s.capacity * n_fullkv);
        }
        n++;
    }
    return n;
}

int32_t llama_polykv_get_kept_positions(const struct llama_context * ctx, int32_t il, llama_pos * out, int32_t n_max) {
    auto * poly = get_poly(ctx);
    if (!poly) {
        set_last_error("the context has no PolyKV plan");
        return -1;
    }
    if (il < 0 || il >= poly->get_plan().n_layer || poly->group_of(il) < 0) {
        set_last_error("layer " + std::to_string(il) + " is out of range or has no cache");
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
        set_last_error(poly ? "layer " + std::to_string(il) + " head " + std::to_string(head) + " is out of range" :
                              std::string("the context has no PolyKV plan"));
        return -1;
    }
    const auto pos = poly->kept_positions(il, head);
    for (int32_t i = 0; i < (int32_t) pos.size() && i < n_max && out; ++i) {
        out[i] = pos[i];
    }
    return (int32_t) pos.size();
}

int32_t llama_polykv_get_kept_scores(const struct llama_context * ctx, int32_t il, int32_t head, float * out, int32_t n_max) {
    auto * poly = get_poly(ctx);
    std::vector<float> sc;
    if (!poly || !poly->kept_scores(il, head, sc)) {
        return -1;
    }
    for (int32_t i = 0; i < (int32_t) sc.size() && i < n_max && out; ++i) {
        out[i] = sc[i];
    }
    return (int32_t) sc.size();
}

int32_t llama_polykv_layer_per_head(const struct llama_context * ctx, int32_t il) {
    auto * poly = get_poly(ctx);
    if (!poly || il < 0 || il >= poly->get_plan().n_layer || poly->group_of(il) < 0) {
        return -1;
    }
    return poly->get_group(poly->group_of(il)).per_head ? 1 : 0;
}

int32_t llama_polykv_layer_cell_pad(const struct llama_context * ctx, int32_t il) {
    auto * poly = get_poly(ctx);
    if (!poly || il < 0 || il >= poly->get_plan().n_layer || poly->group_of(il) < 0) {
        return -1;
    }
    return (int32_t) poly->get_group(poly->group_of(il)).pad;
}

const char * llama_polykv_pattern_str(int32_t pattern) {
    return llama_polykv_pattern_name(pattern);
}

int32_t llama_polykv_seq_get_kept_positions(const struct llama_context * ctx, llama_seq_id seq_id, int32_t il, int32_t head,
                                            llama_pos * out, int32_t n_max) {
    auto * poly = get_poly(ctx, seq_id);
    if (!poly || il < 0 || il >= poly->get_plan().n_layer || poly->group_of(il) < 0 ||
        head >= (int32_t) poly->get_group(poly->group_of(il)).n_head_kv) {
        set_last_error(poly ? "layer " + std::to_string(il) + " head " + std::to_string(head) + " is out of range" :
                              "the context has no PolyKV plan, or no sequence " + std::to_string(seq_id));
        return -1;
    }
    const auto pos = poly->kept_positions(il, head);
    for (int32_t i = 0; i < (int32_t) pos.size() && i < n_max && out; ++i) {
        out[i] = pos[i];
    }
    return (int32_t) pos.size();
}
